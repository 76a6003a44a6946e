/* sync_file_range(2) is declared by glibc only under _GNU_SOURCE, which Swift's Glibc module does
   not set; declare it here (glibc exports it on every Linux architecture). */
#ifdef __linux__
int sync_file_range(int fd, long long offset, long long nbytes, unsigned int flags);
static const unsigned int cwriteback_start = 2; /* SYNC_FILE_RANGE_WRITE */
#endif
