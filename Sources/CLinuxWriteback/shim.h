/* sync_file_range(2), copy_file_range(2), renameat2(2), splice(2), F_SETPIPE_SZ, O_DIRECT and O_TMPFILE are declared by glibc only
   under _GNU_SOURCE, which Swift's Glibc module does not set; declare them here. */
#ifdef __linux__
int sync_file_range(int fd, long long offset, long long nbytes, unsigned int flags);
static const unsigned int cwriteback_start = 2; /* SYNC_FILE_RANGE_WRITE */

#include <sys/syscall.h>
#include <unistd.h>
/* copy_file_range(2), through syscall(2): glibc declares it only under _GNU_SOURCE too. */
static inline long cwriteback_copy_file_range(int in, long long *in_offset, int out, long long *out_offset, unsigned long count) {
#ifdef SYS_copy_file_range
    return syscall(SYS_copy_file_range, in, in_offset, out, out_offset, count, 0);
#else
    return -1;
#endif
}
/* renameat2(2) with RENAME_EXCHANGE: swaps two names in one step (-1 and errno when the kernel or
   file system cannot). Declared by glibc only under _GNU_SOURCE as well. */
#include <errno.h>
#include <fcntl.h>
static inline int cwriteback_exchange(const char *from, const char *to) {
#ifdef SYS_renameat2
    return (int)syscall(SYS_renameat2, AT_FDCWD, from, AT_FDCWD, to, 2 /* RENAME_EXCHANGE */);
#else
    errno = ENOSYS;
    return -1;
#endif
}
/* splice(2) between a socket or file and a pipe (-1 and errno as the call sets them). */
static inline long cwriteback_splice(int in, long long *in_offset, int out, long long *out_offset, unsigned long count) {
#ifdef SYS_splice
    return syscall(SYS_splice, in, in_offset, out, out_offset, count, 0);
#else
    errno = ENOSYS;
    return -1;
#endif
}
/* A close-on-exec pipe asked to hold `size` bytes (a host's fs.pipe-max-size may keep it smaller):
   0, or -1 and errno when no pipe could be made. */
static inline int cwriteback_pipe(int ends[2], int size) {
    if (syscall(SYS_pipe2, ends, O_CLOEXEC) != 0) return -1;
    (void)fcntl(ends[1], 1031 /* F_SETPIPE_SZ */, size);
    return 0;
}
/* fallocate(2) with FALLOC_FL_KEEP_SIZE: reserves the blocks of [offset, offset + length) without
   changing the file's size (-1 and errno; EOPNOTSUPP where the file system cannot). */
static inline int cwriteback_reserve(int fd, long long offset, long long length) {
#ifdef SYS_fallocate
    return (int)syscall(SYS_fallocate, fd, 1 /* FALLOC_FL_KEEP_SIZE */, offset, length);
#else
    errno = EOPNOTSUPP;
    return -1;
#endif
}
/* fallocate(2) with FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: gives the blocks of
   [offset, offset + length) back to the file system, the size unchanged (-1 and errno; EOPNOTSUPP
   where the file system cannot). */
static inline int cwriteback_release(int fd, long long offset, long long length) {
#ifdef SYS_fallocate
    return (int)syscall(SYS_fallocate, fd, 3 /* FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE */, offset, length);
#else
    errno = EOPNOTSUPP;
    return -1;
#endif
}
#if defined(__x86_64__) || defined(__i386__)
static const int cwriteback_o_direct = 040000;
static const int cwriteback_o_tmpfile = 020000000 | 0200000; /* __O_TMPFILE | O_DIRECTORY */
#elif defined(__aarch64__) || defined(__arm__)
static const int cwriteback_o_direct = 0200000;
static const int cwriteback_o_tmpfile = 020000000 | 040000;
#else
static const int cwriteback_o_direct = 0; /* unknown: no direct I/O, buffered writes only */
static const int cwriteback_o_tmpfile = 0; /* unknown: named temporary files only */
#endif
#endif
