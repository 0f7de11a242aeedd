/*
 * belayer-criu-tar: the `tar` CRIU runs, inside the freeze, to dump each tmpfs of a
 * container (Docker's /dev, /dev/shm, /sys/fs/cgroup, the masked /sys/firmware and
 * /proc/acpi, the sandbox's /run/belayer).
 *
 * Why: CRIU runs `tar --create --gzip ...` once per tmpfs, and GNU tar then runs gzip:
 * two dynamically linked programs per mount, ~4-5 ms each on this VM, ~25 ms of the
 * frozen window for six small trees. This static program writes the same archive (GNU
 * format, byte for byte what GNU tar 1.34 writes for such a tree) and compresses it
 * in-process (zlib, level 1), so the restore's `tar --extract --gzip` reads it as before.
 *
 * It takes only the exact command line CRIU 4.x uses to dump a tmpfs, and only trees it
 * writes exactly like GNU tar: directories, regular files that are neither sparse nor
 * hard-linked, symlinks, device nodes and FIFOs, names short enough for one header.
 * Anything else (another command line, a socket, a hard link, a sparse file, a long
 * name, a file on another mount that is not a directory, a tree deeper than MAX_DEPTH or
 * larger than MAX_ENTRIES, a kernel without openat2) is handed to the real tar
 * (REAL_TAR) before a byte is written, with the same arguments and descriptors. Once
 * writing has begun, any surprise (a file that changed size under it) fails the dump:
 * CRIU then resumes the container and reports the dump failed; a wrong archive is never
 * written. The runtime puts this program first in PATH for its dumps
 * (belayer_env/checkpoint/runtime.py, BELAYER_CRIU_FAST_TAR), set-up first in dockerd's,
 * whose CRIU restores run it to extract (criu_untar.c, dispatched from main below).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <zlib.h>

#include "criu_tar.h"

#define BLOCK 512
#define RECORD (20 * BLOCK) /* GNU tar's default record: the archive is padded to it */
#define MAX_DEPTH 64
#define MAX_ENTRIES 100000 /* more (a sandbox can make millions): GNU tar, which streams */

static const char *const criu_create_argv[] = {
    "tar", "--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system",
    "--check-links", "--preserve-permissions", "--sparse", "--numeric-owner",
    "--directory", "/proc/self/fd/0", ".", NULL};

struct entry {
    char *name;        /* as archived: "./", "./a", "./d/" */
    char *link;        /* symlink target */
    struct stat st;
};

static struct entry *entries;
static size_t n_entries, cap_entries;

/* The real tar, same arguments and descriptors: used for everything not taken here. */
void hand_over(char **argv)
{
    execv(REAL_TAR, argv);
    fprintf(stderr, "belayer-criu-tar: cannot run %s: %s\n", REAL_TAR, strerror(errno));
    _exit(2);
}

static int same_argv(char **argv)
{
    int i;
    for (i = 0; criu_create_argv[i]; i++)
        if (!argv[i] || strcmp(argv[i], criu_create_argv[i]) != 0)
            return 0;
    return argv[i] == NULL;
}

/* 0 when the entry was recorded, -1 when this tree is not one this program writes. */
static int add(const char *name, const struct stat *st, const char *link)
{
    if (n_entries == MAX_ENTRIES)
        return -1;
    if (n_entries == cap_entries) {
        cap_entries = cap_entries ? 2 * cap_entries : 64;
        entries = realloc(entries, cap_entries * sizeof(*entries));
        if (!entries)
            return -1;
    }
    entries[n_entries].name = strdup(name);
    entries[n_entries].link = link ? strdup(link) : NULL;
    entries[n_entries].st = *st;
    if (!entries[n_entries].name || (link && !entries[n_entries].link))
        return -1;
    n_entries++;
    return 0;
}

static int is_sparse(const struct stat *st)
{
    /* GNU tar's test (ST_IS_SPARSE) */
    return st->st_blocks < st->st_size / 512 + (st->st_size % 512 != 0);
}

/* Record dir (open at fd, archived as prefix) and, depth first in readdir order as GNU
 * tar's savedir returns them, everything below it on the same file system. */
static int walk(int fd, const char *prefix, int depth)
{
    DIR *d;
    struct dirent *de;
    int ret = 0;

    if (depth > MAX_DEPTH)
        return -1;
    d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -1;
    }
    /* GNU tar reads a directory whole before it archives anything in it. */
    size_t n_names = 0, cap_names = 0;
    char **names = NULL;
    while ((errno = 0, de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if (n_names == cap_names) {
            cap_names = cap_names ? 2 * cap_names : 32;
            char **grown = realloc(names, cap_names * sizeof(*names));
            if (!grown) { ret = -1; goto out; }
            names = grown;
        }
        if (!(names[n_names++] = strdup(de->d_name))) { ret = -1; goto out; }
    }
    if (errno) { ret = -1; goto out; }
    struct stat dir_st;
    if (fstat(dirfd(d), &dir_st) < 0) { ret = -1; goto out; }
    for (size_t i = 0; i < n_names && ret == 0; i++) {
        char path[BLOCK];
        struct stat st;
        int n = snprintf(path, sizeof(path), "%s%s", prefix, names[i]);
        if (n < 0 || n >= 99) { ret = -1; break; } /* one header's name field, "/" included */
        if (fstatat(dirfd(d), names[i], &st, AT_SYMLINK_NOFOLLOW) < 0) { ret = -1; break; }
        if (S_ISDIR(st.st_mode)) {
            strcat(path, "/");
            if (add(path, &st, NULL) < 0) { ret = -1; break; }
            if (st.st_dev != dir_st.st_dev)
                continue; /* --one-file-system: a mount point's own header, nothing below */
            int sub = openat(dirfd(d), names[i], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub < 0 || walk(sub, path, depth + 1) < 0) { ret = -1; break; }
        } else if (st.st_dev != dir_st.st_dev || (st.st_nlink > 1)) {
            ret = -1; /* a mounted file or a hard link: GNU tar's business */
        } else if (S_ISREG(st.st_mode)) {
            if (is_sparse(&st) || st.st_size >= 077777777777LL) { ret = -1; break; }
            ret = add(path, &st, NULL);
        } else if (S_ISLNK(st.st_mode)) {
            char target[BLOCK];
            ssize_t len = readlinkat(dirfd(d), names[i], target, sizeof(target));
            if (len < 0 || len >= 100 || len != st.st_size) { ret = -1; break; }
            target[len] = 0;
            ret = add(path, &st, target);
        } else if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) || S_ISFIFO(st.st_mode)) {
            ret = add(path, &st, NULL);
        } else {
            ret = -1; /* a socket */
        }
    }
out:
    for (size_t i = 0; i < n_names; i++)
        free(names[i]);
    free(names);
    closedir(d);
    return ret;
}

/* --- writing ---------------------------------------------------------------------- */

static z_stream z;
static unsigned char zout[1 << 16];
static unsigned long long written;

static void die(const char *what, const char *name)
{
    fprintf(stderr, "belayer-criu-tar: %s%s%s\n", what, name ? ": " : "", name ? name : "");
    _exit(2);
}

static void flush_z(int flush)
{
    do {
        z.next_out = zout;
        z.avail_out = sizeof(zout);
        if (deflate(&z, flush) == Z_STREAM_ERROR)
            die("deflate failed", NULL);
        size_t have = sizeof(zout) - z.avail_out;
        for (size_t off = 0; off < have;) {
            ssize_t w = write(STDOUT_FILENO, zout + off, have - off);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                die("write failed", strerror(errno));
            off += (size_t)w;
        }
    } while (z.avail_out == 0);
}

static void emit(const void *buf, size_t len)
{
    z.next_in = (unsigned char *)buf;
    z.avail_in = (unsigned)len;
    while (z.avail_in)
        flush_z(Z_NO_FLUSH);
    written += len;
}

static void octal(char *field, size_t size, unsigned long long v)
{
    /* size - 1 zero-padded octal digits, then NUL: GNU tar's to_octal */
    field[size - 1] = 0;
    for (size_t i = size - 1; i-- > 0; v >>= 3)
        field[i] = (char)('0' + (v & 7));
    if (v)
        die("a field does not fit a GNU header", NULL); /* ruled out before writing */
}

static void header(const struct entry *e)
{
    char h[BLOCK];
    const struct stat *st = &e->st;
    char type;
    unsigned long long size = 0;

    if (S_ISREG(st->st_mode)) { type = '0'; size = (unsigned long long)st->st_size; }
    else if (S_ISDIR(st->st_mode)) type = '5';
    else if (S_ISLNK(st->st_mode)) type = '2';
    else if (S_ISCHR(st->st_mode)) type = '3';
    else if (S_ISBLK(st->st_mode)) type = '4';
    else type = '6';
    memset(h, 0, sizeof(h));
    memcpy(h, e->name, strlen(e->name));
    octal(h + 100, 8, st->st_mode & 07777);
    octal(h + 108, 8, st->st_uid);
    octal(h + 116, 8, st->st_gid);
    octal(h + 124, 12, size);
    octal(h + 136, 12, (unsigned long long)st->st_mtime);
    h[156] = type;
    if (e->link)
        memcpy(h + 157, e->link, strlen(e->link));
    memcpy(h + 257, "ustar  ", 8); /* GNU magic + version */
    if (type == '3' || type == '4') {
        octal(h + 329, 8, major(st->st_rdev));
        octal(h + 337, 8, minor(st->st_rdev));
    }
    memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (int i = 0; i < BLOCK; i++)
        sum += (unsigned char)h[i];
    octal(h + 148, 7, sum); /* 6 digits, NUL, and the space left in place */
    emit(h, sizeof(h));
}

static int open_beneath(int root, const char *name)
{
    struct open_how how = {.flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV};
    return (int)syscall(SYS_openat2, root, name, &how, sizeof(how));
}

static void body(int root, const struct entry *e)
{
    static unsigned char buf[1 << 16];
    unsigned long long left = (unsigned long long)e->st.st_size;
    int fd = open_beneath(root, e->name);
    struct stat now;

    if (fd < 0)
        die("cannot open", e->name);
    if (fstat(fd, &now) < 0 || now.st_size != e->st.st_size || now.st_ino != e->st.st_ino)
        die("file changed while the tmpfs was dumped", e->name);
    while (left) {
        ssize_t r = read(fd, buf, left < sizeof(buf) ? (size_t)left : sizeof(buf));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            die("file shrank while the tmpfs was dumped", e->name);
        emit(buf, (size_t)r);
        left -= (unsigned long long)r;
    }
    close(fd);
    size_t pad = (size_t)(-e->st.st_size & (BLOCK - 1));
    if (pad) {
        memset(buf, 0, pad);
        emit(buf, pad);
    }
}

int main(int argc, char **argv)
{
    (void)argc;
    if (is_extract_argv(argv))
        return untar(argv);
    if (!same_argv(argv))
        hand_over(argv);

    /* A description of our own: the walk never moves fd 0's offset, which the real tar
     * (should we hand over) reopens through /proc/self/fd/0 anyway. */
    int root = openat(STDIN_FILENO, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat root_st;
    if (root < 0 || fstat(root, &root_st) < 0)
        hand_over(argv);
    if (add("./", &root_st, NULL) < 0)
        hand_over(argv);
    int probe = open_beneath(root, "."); /* files are read through openat2 (Linux >= 5.6) */
    if (probe < 0)
        hand_over(argv);
    close(probe);
    int walk_fd = dup(root);
    if (walk_fd < 0 || walk(walk_fd, "./", 0) < 0)
        hand_over(argv);
    for (size_t i = 0; i < n_entries; i++) {
        const struct stat *st = &entries[i].st;
        if (st->st_uid > 07777777 || st->st_gid > 07777777 || st->st_mtime < 0 ||
            st->st_mtime > 077777777777LL ||
            ((S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode)) &&
             (major(st->st_rdev) > 07777777 || minor(st->st_rdev) > 07777777)))
            hand_over(argv);
    }

    if (deflateInit2(&z, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
        hand_over(argv);
    for (size_t i = 0; i < n_entries; i++) {
        header(&entries[i]);
        if (S_ISREG(entries[i].st.st_mode))
            body(root, &entries[i]);
    }
    static unsigned char zeros[RECORD];
    emit(zeros, 2 * BLOCK);
    emit(zeros, (size_t)((RECORD - written % RECORD) % RECORD));
    z.next_in = NULL;
    z.avail_in = 0;
    flush_z(Z_FINISH);
    deflateEnd(&z);
    return 0;
}
