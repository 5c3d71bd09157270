/* omni_async's loops in C, called through ctypes (omni_async.transport.native loads this library).
 *
 * A plain C library, not a Python module: no Python API, no GIL taken (ctypes releases it
 * around each call).  Each loop does in one call what Python did one step at a time.
 *
 * Row copies (omni_async.transport.memcopy): a write of 256 scattered 64 KiB blocks was 256
 * numpy assignments; here it is one call, every run checked against both arrays before any
 * byte moves.  Streaming stores for large copies: an ordinary store first reads the
 * destination's cache line (a read for ownership), and a large copy evicts both processes'
 * working sets from the caches; a non-temporal store writes the line without reading it and
 * leaves the caches alone.  Streaming is the caller's choice (large copies only: a small one
 * the peer may read soon is better left in the cache).
 *
 * Puts (omni_async.transport.rma): a write's one-sided puts, one ucp_put_nbi per run and
 * region, were one ctypes call each; here one call posts them all, through the function
 * pointer the caller passes (the libucp that ucxx loaded: this library links nothing).
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define OMNI_STREAM 1
#else
#define OMNI_STREAM 0
#endif

#define PIECE ((size_t)256 * 1024) /* an ordinary copy goes in pieces of this size: see memcopy.COPY_PIECE */

/* The version of these functions' signatures: native.py refuses a library built from another. */
int omni_native_version(void) { return 2; }

/* 1 if this build has streaming stores (x86-64: SSE2, part of the base instruction set). */
int omni_can_stream(void) { return OMNI_STREAM; }

static void copy_bytes(char *dst, const char *src, size_t n, int stream) {
#if OMNI_STREAM
    if (stream && n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* streaming stores need 16-byte aligned targets */
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    (void)stream;
    for (size_t at = 0; at < n; at += PIECE) {
        memcpy(dst + at, src + at, n - at < PIECE ? n - at : PIECE);
    }
}

static void fence(int stream) {
#if OMNI_STREAM
    if (stream) {
        _mm_sfence(); /* streaming stores are weakly ordered: all visible before we return */
    }
#endif
    (void)stream;
}

/* Copy runs of rows of `row` bytes: for each of the n runs (three uint64 each: local, remote,
 * count), `count` rows from src row runs[3k + src_col] on go to dst row runs[3k + dst_col] on
 * (columns 0: local, 1: remote).  Every run is checked against `dst_rows` and `src_rows` before
 * any byte moves: returns -1 (nothing copied) if one falls outside either (or a column is not
 * 0 or 1), else 0.  Streaming stores if the runs hold at least `stream_min` bytes (0: never),
 * fenced before returning. */
int omni_copy_runs(char *dst, uint64_t dst_rows, int dst_col, const char *src, uint64_t src_rows, int src_col,
                   uint64_t row, const uint64_t *runs, size_t n, uint64_t stream_min) {
    if ((dst_col | src_col) & ~1) {
        return -1; /* a column is 0 (local) or 1 (remote) */
    }
    uint64_t rows = 0;
    for (size_t k = 0; k < n; k++) {
        const uint64_t *run = runs + 3 * k;
        uint64_t count = run[2];
        if (count > dst_rows || run[dst_col] > dst_rows - count || count > src_rows ||
            run[src_col] > src_rows - count) {
            return -1;
        }
        rows += count;
    }
    int stream = stream_min > 0 && rows * row >= stream_min;
    for (size_t k = 0; k < n; k++) {
        const uint64_t *run = runs + 3 * k;
        copy_bytes(dst + run[dst_col] * row, src + run[src_col] * row, run[2] * row, stream);
    }
    fence(stream);
    return 0;
}

/* Copy n bytes (non-overlapping); streaming stores if n >= stream_min (0: never). */
void omni_copy(char *dst, const char *src, uint64_t n, uint64_t stream_min) {
    int stream = stream_min > 0 && n >= stream_min;
    copy_bytes(dst, src, n, stream);
    fence(stream);
}

/* ucp_put_nbi: ucs_status_t is a packed enum (one signed byte). */
typedef int8_t (*put_nbi_fn)(void *ep, const void *buffer, size_t length, uint64_t remote_addr, void *rkey);

/* Post a put per row of `puts` (n rows of four uint64: local address, length, remote address,
 * remote key) on endpoint `ep` through `put` (ucp_put_nbi).  Returns 0, or the first negative
 * status UCX returned (the puts before it stay posted). */
int omni_put_all(put_nbi_fn put, void *ep, const uint64_t *puts, size_t n) {
    for (size_t k = 0; k < n; k++) {
        const uint64_t *p = puts + 4 * k;
        int8_t status = put(ep, (const void *)(uintptr_t)p[0], (size_t)p[1], p[2], (void *)(uintptr_t)p[3]);
        if (status < 0) {
            return status;
        }
    }
    return 0;
}
