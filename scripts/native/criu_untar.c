/*
 * belayer-criu-tar, extract side: the `tar --extract --gzip` CRIU runs to fill each tmpfs
 * of a container it restores (Docker's /dev, /dev/shm, ..., the sandbox's /run/belayer).
 *
 * Why: GNU tar runs gzip through a shell: three dynamically linked programs per mount,
 * ~5 ms each here, ~30 ms of every restore's 75 ms inside CRIU (restore.log), and 48
 * process starts for a fork of 8. This reads the archive in-process (zlib) and makes
 * what GNU tar 1.34 makes of it when run as root with CRIU's arguments: the same
 * entries, modes (set-id bits included), numeric owners, mtimes; the directories' own
 * metadata set once their entries are in, as GNU tar's delayed set-stat does.
 *
 * Two passes over the stream. The first reads the whole archive and writes nothing; it
 * takes only archives made like the dump side makes them (and GNU tar with CRIU's dump
 * arguments): GNU headers with valid checksums, octal fields, no owner names, entries
 * "./" first and then "./..." of a directory, regular file, symlink, device or FIFO,
 * each with its parent already listed, no name twice, a single gzip member ending
 * with the archive. It also needs an empty target directory and a seekable stdin (CRIU
 * gives the image file). Anything else is handed to the real tar from the stream's
 * start, before a byte is written. The second pass extracts; a failure there (no
 * space, say) fails the restore, as GNU tar's would. One line in CRIU's log (stdout)
 * says the in-process path ran. A file named restore-off beside this program sends every
 * extraction to the real tar.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>
#include <zlib.h>

#include "criu_tar.h"

#define BLOCK 512
#define MAX_ENTRIES 100000

static const char *const criu_extract_argv[] = {
    "tar", "--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory", NULL};

int is_extract_argv(char **argv)
{
    int i;
    for (i = 0; criu_extract_argv[i]; i++)
        if (!argv[i] || strcmp(argv[i], criu_extract_argv[i]) != 0)
            return 0;
    return argv[i] != NULL && argv[i + 1] == NULL; /* the directory, and nothing after it */
}

struct member {
    char name[101];     /* as archived, "./" included; a directory's trailing "/" dropped */
    char link[101];
    char type;
    mode_t mode;
    uid_t uid;
    gid_t gid;
    time_t mtime;
    dev_t rdev;
    unsigned long long size;
    size_t order;       /* its place in the archive */
};

/* --- reading the stream ----------------------------------------------------------- */

static z_stream zin;
static unsigned char zbuf[1 << 16], out[1 << 16];
static size_t out_len, out_pos;
static int stream_end;

static int rewind_stream(off_t start)
{
    if (lseek(STDIN_FILENO, start, SEEK_SET) != start)
        return -1;
    inflateEnd(&zin);
    memset(&zin, 0, sizeof(zin));
    out_len = out_pos = 0;
    stream_end = 0;
    return inflateInit2(&zin, 15 + 16) == Z_OK ? 0 : -1;
}

/* Fill `out` with more of the archive; 0 at the end of the gzip member, -1 on anything
 * the real tar should judge (a bad stream, a second member, bytes after it). */
static int refill(void)
{
    out_len = out_pos = 0;
    while (out_len == 0) {
        if (stream_end)
            return 0;
        if (zin.avail_in == 0) {
            ssize_t r;
            do r = read(STDIN_FILENO, zbuf, sizeof(zbuf)); while (r < 0 && errno == EINTR);
            if (r < 0)
                return -1;
            if (r == 0)
                return -1; /* the stream ended before the gzip member did */
            zin.next_in = zbuf;
            zin.avail_in = (unsigned)r;
        }
        zin.next_out = out;
        zin.avail_out = sizeof(out);
        int rc = inflate(&zin, Z_NO_FLUSH);
        out_len = sizeof(out) - zin.avail_out;
        if (rc == Z_STREAM_END) {
            char extra;
            ssize_t r;
            if (zin.avail_in != 0)
                return -1; /* another member or trailing bytes */
            do r = read(STDIN_FILENO, &extra, 1); while (r < 0 && errno == EINTR);
            if (r != 0)
                return -1;
            stream_end = 1;
        } else if (rc == Z_BUF_ERROR ? zin.avail_in != 0 : rc != Z_OK) {
            return -1; /* Z_BUF_ERROR with all input used: read more */
        }
    }
    return 1;
}

/* Copy the next `len` bytes of the archive to `dst` (NULL: skip them); -1 if it ends first. */
static int take(void *dst, size_t len)
{
    while (len) {
        if (out_pos == out_len && refill() <= 0)
            return -1;
        size_t n = out_len - out_pos < len ? out_len - out_pos : len;
        if (dst) {
            memcpy(dst, out + out_pos, n);
            dst = (char *)dst + n;
        }
        out_pos += n;
        len -= n;
    }
    return 0;
}

/* --- one header -------------------------------------------------------------------- */

static int all_zero(const unsigned char *p, size_t n)
{
    while (n--)
        if (*p++)
            return 0;
    return 1;
}

/* An octal field as GNU tar writes it (digits, then NUL or space); -1 for anything else. */
static int octal_field(const unsigned char *f, size_t size, unsigned long long *v)
{
    size_t i = 0;
    *v = 0;
    while (i < size && f[i] == ' ')
        i++;
    if (i == size || f[i] < '0' || f[i] > '7')
        return -1;
    for (; i < size && f[i] >= '0' && f[i] <= '7'; i++)
        *v = (*v << 3) | (unsigned)(f[i] - '0');
    for (; i < size; i++)
        if (f[i] != 0 && f[i] != ' ')
            return -1;
    return 0;
}

static int name_field(const unsigned char *f, char *dst)
{
    size_t n = strnlen((const char *)f, 100);
    if (n == 100 || !all_zero(f + n, 100 - n))
        return -1;
    memcpy(dst, f, n);
    dst[n] = 0;
    return 0;
}

/* "./" or "./a/b" with no empty, "." or ".." component (a directory's "/" already dropped). */
static int safe_name(const char *name)
{
    if (strcmp(name, ".") == 0)
        return 1;
    if (strncmp(name, "./", 2) != 0)
        return 0;
    for (const char *c = name + 2;;) {
        const char *end = strchr(c, '/');
        size_t len = end ? (size_t)(end - c) : strlen(c);
        if (len == 0 || (len == 1 && c[0] == '.') || (len == 2 && c[0] == '.' && c[1] == '.'))
            return 0;
        if (!end)
            return 1;
        c = end + 1;
    }
}

/* Parse one header block into m; 1: a member, 0: a zero block, -1: not for us. */
static int parse_header(const unsigned char *h, struct member *m)
{
    unsigned long long v, sum = 0, stored;
    if (all_zero(h, BLOCK))
        return 0;
    for (int i = 0; i < BLOCK; i++)
        sum += (i >= 148 && i < 156) ? ' ' : h[i];
    if (octal_field(h + 148, 8, &stored) < 0 || stored != sum)
        return -1;
    if (memcmp(h + 257, "ustar  ", 8) != 0)
        return -1; /* GNU format only */
    if (!all_zero(h + 265, 64) || !all_zero(h + 345, BLOCK - 345))
        return -1; /* owner names (GNU tar would look them up), or GNU extensions */
    memset(m, 0, sizeof(*m));
    m->type = (char)h[156];
    if (!strchr("023456", m->type) || m->type == 0)
        return -1;
    if (name_field(h, m->name) < 0 || name_field(h + 157, m->link) < 0)
        return -1;
    size_t len = strlen(m->name);
    if (m->type == '5') {
        if (len < 2 || m->name[len - 1] != '/')
            return -1;
        m->name[len - 1] = 0;
    } else if (len && m->name[len - 1] == '/') {
        return -1;
    }
    if (!safe_name(m->name) || (m->type == '2') != (m->link[0] != 0))
        return -1;
    if (octal_field(h + 100, 8, &v) < 0 || v > 07777)
        return -1;
    m->mode = (mode_t)v;
    if (octal_field(h + 108, 8, &v) < 0)
        return -1;
    m->uid = (uid_t)v;
    if (octal_field(h + 116, 8, &v) < 0)
        return -1;
    m->gid = (gid_t)v;
    if (octal_field(h + 124, 12, &m->size) < 0 || (m->type != '0' && m->size))
        return -1;
    if (octal_field(h + 136, 12, &v) < 0)
        return -1;
    m->mtime = (time_t)v;
    if (m->type == '3' || m->type == '4') {
        unsigned long long ma, mi;
        if (octal_field(h + 329, 8, &ma) < 0 || octal_field(h + 337, 8, &mi) < 0)
            return -1;
        m->rdev = makedev(ma, mi);
    } else if (!all_zero(h + 329, 16)) {
        return -1;
    }
    return 1;
}

/* --- pass one: is this an archive we extract exactly as GNU tar would? -------------- */

static struct member *members;
static size_t n_members;

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct member *)a)->name, ((const struct member *)b)->name);
}

static const struct member *find(const struct member *sorted, size_t n, const char *name)
{
    struct member key;
    snprintf(key.name, sizeof(key.name), "%s", name);
    return bsearch(&key, sorted, n, sizeof(*sorted), by_name);
}

static int survey(void)
{
    unsigned char h[BLOCK];
    size_t cap = 0;
    for (;;) {
        if (take(h, BLOCK) < 0)
            return -1; /* no end-of-archive blocks */
        struct member m;
        int r = parse_header(h, &m);
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        if (n_members == 0 ? !(m.type == '5' && strcmp(m.name, ".") == 0) : strcmp(m.name, ".") == 0)
            return -1; /* the mount's root first, and only there */
        if (n_members == MAX_ENTRIES)
            return -1;
        if (n_members == cap) {
            cap = cap ? 2 * cap : 64;
            struct member *grown = realloc(members, cap * sizeof(*members));
            if (!grown)
                return -1;
            members = grown;
        }
        m.order = n_members;
        memcpy(&members[n_members++], &m, sizeof(m)); /* padding included: pass two compares */
        if (take(NULL, (m.size + BLOCK - 1) / BLOCK * BLOCK) < 0)
            return -1;
    }
    /* the second zero block and the record's padding: zeros up to the end */
    unsigned long long zeros = 0;
    for (;;) {
        int r = out_pos == out_len ? refill() : 1;
        if (r < 0)
            return -1;
        if (r == 0)
            return zeros >= BLOCK ? 0 : -1;
        if (!all_zero(out + out_pos, out_len - out_pos))
            return -1;
        zeros += out_len - out_pos;
        out_pos = out_len;
    }
}

/* Every parent listed before its child, as a directory; no name twice. */
static int well_formed(void)
{
    struct member *sorted = malloc(n_members * sizeof(*sorted));
    int ok = sorted != NULL;
    if (!ok)
        return -1;
    memcpy(sorted, members, n_members * sizeof(*sorted));
    qsort(sorted, n_members, sizeof(*sorted), by_name);
    for (size_t i = 1; i < n_members && ok; i++)
        ok = strcmp(sorted[i - 1].name, sorted[i].name) != 0;
    for (size_t i = 1; i < n_members && ok; i++) {
        char parent[101];
        snprintf(parent, sizeof(parent), "%s", members[i].name);
        *strrchr(parent, '/') = 0;
        const struct member *p = find(sorted, n_members, parent);
        ok = p != NULL && p->type == '5' && p->order < i;
    }
    free(sorted);
    return ok ? 0 : -1;
}

static int empty_dir(int dir)
{
    int fd = dup(dir);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    struct dirent *de;
    int empty = d != NULL;
    while (d && (de = readdir(d)) != NULL)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            empty = 0;
    if (d)
        closedir(d);
    return empty;
}

/* --- pass two: make it ------------------------------------------------------------- */

static struct timespec started;

static void fail(const char *what, const char *name)
{
    fprintf(stderr, "belayer-criu-tar: %s %s: %s\n", what, name, strerror(errno));
    _exit(2);
}

/* GNU tar's set_stat: times (atime: when tar started), then owner, then mode. */
static void set_stat(int dir, const struct member *m, int fd)
{
    const char *rel = strcmp(m->name, ".") ? m->name + 2 : ".";
    struct timespec ts[2] = {started, {m->mtime, 0}};
    int nofollow = m->type == '2' ? AT_SYMLINK_NOFOLLOW : 0;
    if ((fd >= 0 ? futimens(fd, ts) : utimensat(dir, rel, ts, nofollow)) < 0)
        fail("cannot set the times of", m->name);
    if ((fd >= 0 ? fchown(fd, m->uid, m->gid) : fchownat(dir, rel, m->uid, m->gid, nofollow)) < 0)
        fail("cannot set the owner of", m->name);
    if (m->type != '2' && (fd >= 0 ? fchmod(fd, m->mode) : fchmodat(dir, rel, m->mode, 0)) < 0)
        fail("cannot set the mode of", m->name);
}

static int under(const char *dir, const char *name)
{
    size_t n = strlen(dir);
    return strncmp(name, dir, n) == 0 && name[n] == '/';
}

static void extract(int dir)
{
    static unsigned char buf[1 << 16];
    size_t *open_dirs = malloc(n_members * sizeof(*open_dirs)), depth = 0;
    unsigned char h[BLOCK];
    if (!open_dirs)
        fail("out of memory for", "the directory stack");
    for (size_t i = 0; i < n_members; i++) {
        const struct member *m = &members[i];
        const char *rel = i ? m->name + 2 : ".";
        struct member again;
        if (take(h, BLOCK) < 0 || parse_header(h, &again) != 1 || (again.order = i, memcmp(&again, m, sizeof(again))))
            fail("archive changed between passes at", m->name);
        /* directories this entry is not in are complete: their metadata now (GNU tar's
         * apply_nonancestor_delayed_set_stat) */
        while (depth && !under(members[open_dirs[depth - 1]].name, m->name))
            set_stat(dir, &members[open_dirs[--depth]], -1);
        switch (m->type) {
        case '5':
            if (i && mkdirat(dir, rel, 0700) < 0)
                fail("cannot make directory", m->name);
            open_dirs[depth++] = i;
            break;
        case '0': {
            int fd = openat(dir, rel, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
            if (fd < 0)
                fail("cannot create", m->name);
            for (unsigned long long left = m->size; left;) {
                size_t n = left < sizeof(buf) ? (size_t)left : sizeof(buf);
                if (take(buf, n) < 0)
                    fail("archive changed between passes at", m->name);
                for (size_t off = 0; off < n;) {
                    ssize_t w = write(fd, buf + off, n - off);
                    if (w < 0 && errno == EINTR)
                        continue;
                    if (w <= 0)
                        fail("cannot write", m->name);
                    off += (size_t)w;
                }
                left -= n;
            }
            if (take(NULL, (size_t)(-m->size & (BLOCK - 1))) < 0)
                fail("archive changed between passes at", m->name);
            set_stat(dir, m, fd);
            close(fd);
            break;
        }
        case '2':
            if (symlinkat(m->link, dir, rel) < 0)
                fail("cannot make symlink", m->name);
            set_stat(dir, m, -1);
            break;
        default: { /* '3', '4', '6' */
            mode_t kind = m->type == '3' ? S_IFCHR : m->type == '4' ? S_IFBLK : S_IFIFO;
            if (mknodat(dir, rel, kind | 0600, m->rdev) < 0)
                fail("cannot make node", m->name);
            set_stat(dir, m, -1);
        }
        }
    }
    while (depth)
        set_stat(dir, &members[open_dirs[--depth]], -1);
    free(open_dirs);
}

/* An operator's (and benchmarks/restore_ab.py's) off switch: a file beside the program. */
static int switched_off(void)
{
    char path[4096];
    ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - sizeof("/restore-off"));
    if (n <= 0)
        return 0;
    path[n] = 0;
    char *slash = strrchr(path, '/');
    if (!slash)
        return 0;
    strcpy(slash, "/restore-off");
    return access(path, F_OK) == 0;
}

int untar(char **argv)
{
    const char *target = argv[6];
    if (switched_off())
        hand_over(argv);
    off_t start = lseek(STDIN_FILENO, 0, SEEK_CUR);
    int dir = open(target, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (start < 0 || dir < 0 || !empty_dir(dir) || rewind_stream(start) < 0)
        hand_over(argv); /* a pipe, or a directory GNU tar would merge into: its business */
    if (survey() < 0 || well_formed() < 0 || rewind_stream(start) < 0) {
        if (lseek(STDIN_FILENO, start, SEEK_SET) != start) {
            fprintf(stderr, "belayer-criu-tar: cannot rewind the archive for %s\n", REAL_TAR);
            return 2;
        }
        hand_over(argv);
    }
    clock_gettime(CLOCK_REALTIME, &started);
    extract(dir);
    printf("belayer-criu-tar: extracted %zu entries in-process\n", n_members);
    return 0;
}
