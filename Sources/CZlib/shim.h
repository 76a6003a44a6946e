#include <stdlib.h>
#include <zlib.h>

/* inflateInit2 is a macro; Swift cannot call macros, so expose it as a function. */
static inline int czlib_inflate_init_raw(z_streamp strm) {
    return inflateInit2(strm, -15);
}

/* The size of `input` as a raw DEFLATE stream at zlib's `level` (what zip -<level> would make of
   it, near enough), or 0 when zlib fails. Used on small samples only. */
static inline size_t czlib_deflated_size(const void *input, size_t count, int level) {
    z_stream s = {0};
    if (deflateInit2(&s, level, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY) != Z_OK) return 0;
    uLong bound = deflateBound(&s, (uLong)count);
    unsigned char *out = malloc(bound);
    size_t size = 0;
    if (out) {
        s.next_in = (Bytef *)input;
        s.avail_in = (uInt)count;
        s.next_out = out;
        s.avail_out = (uInt)bound;
        if (deflate(&s, Z_FINISH) == Z_STREAM_END) size = s.total_out;
        free(out);
    }
    deflateEnd(&s);
    return size;
}
