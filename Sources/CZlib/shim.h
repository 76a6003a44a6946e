#include <zlib.h>

/* inflateInit2 is a macro; Swift cannot call macros, so expose it as a function. */
static inline int czlib_inflate_init_raw(z_streamp strm) {
    return inflateInit2(strm, -15);
}
