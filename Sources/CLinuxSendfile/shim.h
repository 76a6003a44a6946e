/* What ContentDelivery's FileSender needs of Linux that Swift's Glibc module does not bring in:
   epoll(7), eventfd(2) and sendfile(2) (NIO has them in a C module of its own, which it does not
   export), and naming a thread (pthread_setname_np needs _GNU_SOURCE; prctl is variadic). */
#ifdef __linux__
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/sendfile.h>

/* Names the calling thread, as `top -H` and /proc/<pid>/task/<tid>/comm show it (15 bytes kept). */
static inline void clinuxsendfile_name_thread(const char *name) {
    prctl(PR_SET_NAME, name, 0, 0, 0);
}
#endif
