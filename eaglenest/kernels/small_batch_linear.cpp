/* y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode or verify step, on x86-64 with AVX2 + FMA.
 *
 * Why: a decode step (M = 1) and a speculative verify step (M = 2..8) stream every weight once and do little
 * arithmetic with it, so they should cost about the same. General-purpose BLAS sgemm kernels are tuned for large M:
 * on an AVX2 CPU a 6-row product costs ~2.2x a 1-row one there, which eats most of what speculation saves.
 *
 * Layout: W is pre-packed into panels of 16 output columns, each panel K x 16 contiguous (``pack_weight``), so
 * one pass reads the whole matrix as a single sequential stream. Per panel, up to 6 rows of x are held in 12 ymm
 * accumulators; each k loads 16 weights once and issues 12 FMAs. Every output element is the same sequence of
 * FMAs over k whatever M is and wherever its row sits in a block, so a row's result does not depend on the batch
 * it is computed in (greedy speculative decoding stays token-identical to plain decoding).
 *
 * Built by torch.utils.cpp_extension (eaglenest/kernels/build.py) and registered as the torch operator
 * ``eaglenest::small_batch_linear``; plain C++ apart from that registration at the end.
 */
#include <immintrin.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#define PANEL 16
#define ROWS 6

#define ACC(i) if (MM > i) { __m256 xb = _mm256_broadcast_ss(x + (long)(i) * K + k); \
    c##i##a = _mm256_fmadd_ps(xb, w0, c##i##a); c##i##b = _mm256_fmadd_ps(xb, w1, c##i##b); }
#define STORE(i) if (MM > i) { _mm256_storeu_ps(t, c##i##a); _mm256_storeu_ps(t + 8, c##i##b); \
    for (long j = 0; j < ncols; j++) y[(long)(i) * ldy + j] = t[j]; }

static inline __attribute__((always_inline)) void panel_rows(const float *__restrict__ x, long K,
                                                             const float *__restrict__ wp, float *__restrict__ y,
                                                             long ldy, long ncols, const int MM) {
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a, c1a = c0a, c1b = c0a, c2a = c0a, c2b = c0a,
           c3a = c0a, c3b = c0a, c4a = c0a, c4b = c0a, c5a = c0a, c5b = c0a;
    for (long k = 0; k < K; k++) {
        _mm_prefetch((const char *)(wp + (k + 16) * PANEL), _MM_HINT_T0);
        __m256 w0 = _mm256_loadu_ps(wp + k * PANEL);
        __m256 w1 = _mm256_loadu_ps(wp + k * PANEL + 8);
        ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)
    }
    float t[PANEL];
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

/* rows [m_lo, m_hi) of y for one panel */
static void one_panel(const float *x, long m_lo, long m_hi, long K, const float *wp, long N, float *y, long p) {
    const float *w = wp + p * K * PANEL;
    long ncols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    for (long m0 = m_lo; m0 < m_hi; m0 += ROWS) {
        long mm = m_hi - m0 < ROWS ? m_hi - m0 : ROWS;
        const float *xs = x + m0 * K;
        float *ys = y + m0 * N + p * PANEL;
        switch (mm) {
            case 1: panel_rows(xs, K, w, ys, N, ncols, 1); break;
            case 2: panel_rows(xs, K, w, ys, N, ncols, 2); break;
            case 3: panel_rows(xs, K, w, ys, N, ncols, 3); break;
            case 4: panel_rows(xs, K, w, ys, N, ncols, 4); break;
            case 5: panel_rows(xs, K, w, ys, N, ncols, 5); break;
            default: panel_rows(xs, K, w, ys, N, ncols, 6); break;
        }
    }
}

/* Rows of x handled against every panel before moving on: their slice of x (TILE_BYTES) stays in L2 while the
 * weights stream past, so a long prefill re-reads the weights M / tile times instead of re-reading all of x from
 * memory for every panel. Decode and verify steps (M <= 6) are one tile. */
#define TILE_BYTES (512L * 1024L)

/* x: M x K row-major; wp: ceil(N/16) panels of K x 16; y: M x N row-major. */
static void small_batch_linear_raw(const float *x, long M, long K, const float *wp, long N, float *y, int threads) {
    long panels = (N + PANEL - 1) / PANEL;
    long tile = TILE_BYTES / (K * (long)sizeof(float)) / ROWS * ROWS;
    if (tile < ROWS) tile = ROWS;
    for (long m_lo = 0; m_lo < M; m_lo += tile) {
        long m_hi = M - m_lo < tile ? M : m_lo + tile;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long p = 0; p < panels; p++) one_panel(x, m_lo, m_hi, K, wp, N, y, p);
    }
}

/* y = x @ W^T for x [M, K] float32 contiguous on the CPU and W packed by ``pack_weight`` ([ceil(N/16), K, 16]). */
static at::Tensor small_batch_linear(const at::Tensor &x, const at::Tensor &packed, int64_t n, int64_t threads) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "small_batch_linear: x must be a contiguous 2-d float32 CPU tensor");
    TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat &&
                    packed.size(1) == x.size(1) && packed.size(2) == PANEL && packed.size(0) * PANEL >= n,
                "small_batch_linear: packed must be [ceil(n/16), K, 16] float32, contiguous");
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    if (x.size(0) > 0)
        small_batch_linear_raw(x.data_ptr<float>(), x.size(0), x.size(1), packed.data_ptr<float>(), n,
                               y.data_ptr<float>(), (int)threads);
    return y;
}

TORCH_LIBRARY(eaglenest, m) {
    m.def("small_batch_linear(Tensor x, Tensor packed, int n, int threads) -> Tensor", &small_batch_linear);
}
