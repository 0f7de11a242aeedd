/* belayer-criu-tar: what its two halves (criu_tar.c: dump, criu_untar.c: restore) share. */
#ifndef BELAYER_CRIU_TAR_H
#define BELAYER_CRIU_TAR_H

#ifndef REAL_TAR
#define REAL_TAR "/usr/bin/tar"
#endif

/* Run the real tar with the same arguments and descriptors; never returns. */
void hand_over(char **argv) __attribute__((noreturn));
/* CRIU's `tar --extract --gzip ... --directory DIR` of a tmpfs image? */
int is_extract_argv(char **argv);
int untar(char **argv);

#endif
