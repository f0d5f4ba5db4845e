// What one more row of a verify pass costs in the patch's AVX2 multi-row GEMVs (repacked Q4_K and Q6_K), next to
// what this core can do: its throughput of the int8 multiply the kernels are made of (vpmaddubsw; AVX2 has no
// VNNI). Each kernel takes a fixed number of multiply instructions per row and per 8 columns x 256 weights (Q4_K:
// 64 vpmaddubsw + 8 vpmaddwd; Q6_K: 64 + 32; both kinds run on the same ports), so a row's cost divided by that
// count, against the time per multiply of a loop of nothing else, says how close a row is to the core's bound.
// One thread, the 1.5b's ffn_up shape (8960 x 1536), weights resident in cache (one matrix, 7.7 / 11.3 MB), every
// figure the fastest of many tries, all in one run.
// Built beside the AVX2 libraries by scripts/build_llama_variant.sh avx2 (docs/exactness.md):
//   "$(bash scripts/build_llama_variant.sh avx2)/kernel_bound"            (--quick: a few tries, for the tests)
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

extern "C" {  // ggml-cpu's kernels (ggml/src/ggml-cpu/repack.h): rows of vy are consecutive, rows of s bs apart
void ggml_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K_rows(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q6_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q6_K_8x8_q8_K_rows(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
}

using kernel = void (*)(int, float *, size_t, const void *, const void *, int, int);

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// seconds per vpmaddubsw on each of `threads` threads running at once: twelve independent chains each (each
// product the next one's operand), more than its latency times its throughput, so the multiplier sets the pace. In
// assembly, so that the twelve stay in registers: compiled from intrinsics, the accumulators went through the stack
// on every iteration and the stores set the pace instead (half the multiplier's rate on Zen 3)
static double multiply_seconds(int tries, int threads) {
    const long iters = 2000000;
    double best = 1e9;
    for (int t = 0; t < tries; t++) {
        std::vector<std::thread> pool;
        const double t0 = now();
        for (int th = 0; th < threads; th++) {
            pool.emplace_back([] {
                __m256i a0 = _mm256_set1_epi16(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,
                        a8 = a0, a9 = a0, a10 = a0, a11 = a0;
                const __m256i x = _mm256_set1_epi8(5);
                for (long k = 0; k < iters; k++) {
                    __asm__ volatile(
                        "vpmaddubsw %12, %0, %0\n\tvpmaddubsw %12, %1, %1\n\tvpmaddubsw %12, %2, %2\n\t"
                        "vpmaddubsw %12, %3, %3\n\tvpmaddubsw %12, %4, %4\n\tvpmaddubsw %12, %5, %5\n\t"
                        "vpmaddubsw %12, %6, %6\n\tvpmaddubsw %12, %7, %7\n\tvpmaddubsw %12, %8, %8\n\t"
                        "vpmaddubsw %12, %9, %9\n\tvpmaddubsw %12, %10, %10\n\tvpmaddubsw %12, %11, %11"
                        : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8),
                          "+x"(a9), "+x"(a10), "+x"(a11)
                        : "x"(x));
                }
                volatile int sink = _mm256_extract_epi16(a0, 0) + _mm256_extract_epi16(a11, 0);
                (void) sink;
            });
        }
        for (auto & th : pool) th.join();
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    return best / iters / 12;
}

int main(int argc, char ** argv) {
    const bool quick = argc > 1 && !strcmp(argv[1], "--quick");
    const int tries = quick ? 2 : 30;
    const int n = 1536, nc = 8960, nb = n / 256, units = nc / 8 * nb;  // a unit: 8 columns x 256 weights
    const size_t q8_block = 4 + 256 + 2 * 16;                          // block_q8_K: d, qs, bsums
    std::mt19937 rng(1);
    std::vector<uint8_t> act(16 * nb * q8_block);
    for (auto & b : act) b = rng() & 0x7f;
    for (int r = 0; r < 16 * nb; r++) {
        const float d = 0.01f;
        memcpy(&act[r * q8_block], &d, sizeof(d));
    }
    std::vector<float> out(16 * nc);

    const double mul = multiply_seconds(tries, 1);
    const int cores = (int) std::thread::hardware_concurrency();
    printf("this core: %.3f ns per vpmaddubsw (one thread); %.3f ns on each of %d threads at once\n\n", 1e9 * mul,
           1e9 * multiply_seconds(tries, cores), cores);
    printf("%-5s %5s %11s %14s %16s %20s %9s\n", "type", "rows", "us/call", "vs one row", "us per more row",
           "ns per multiply", "of bound");

    struct {
        const char * name;
        size_t block;    // bytes per unit (block_q4_Kx8, block_q6_Kx8)
        int scales;      // fp16 scales at the start of a block (d, and dmin for Q4_K)
        int multiplies;  // multiply instructions per row and unit
        kernel one, rows;
    } types[] = {
        {"q4_K", 1152, 16, 64 + 8, ggml_gemv_q4_K_8x8_q8_K, ggml_gemv_q4_K_8x8_q8_K_rows},
        {"q6_K", 1680, 8, 64 + 32, ggml_gemv_q6_K_8x8_q8_K, ggml_gemv_q6_K_8x8_q8_K_rows},
    };
    for (const auto & t : types) {
        std::vector<uint8_t> w((size_t) units * t.block);
        for (auto & b : w) b = rng() & 0xff;
        for (int u = 0; u < units; u++) {
            for (int i = 0; i < t.scales; i++) {
                const uint16_t h = 0x2000 + (rng() & 0x3ff);  // small normal fp16 values
                memcpy(&w[(size_t) u * t.block + 2 * i], &h, sizeof(h));
            }
        }
        // every row count in each try, the tries interleaved, so the machine's slower moments fall on all of them
        const int counts[] = {1, 2, 4, 8, 16};
        double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9};
        for (int k = 0; k < tries * 4; k++) {
            for (int c = 0; c < 5; c++) {
                const double t0 = now();
                if (counts[c] == 1) {
                    t.one(n, out.data(), nc, w.data(), act.data(), 1, nc);
                } else {
                    t.rows(n, out.data(), nc, w.data(), act.data(), counts[c], nc);
                }
                const double dt = now() - t0;
                if (dt < best[c]) best[c] = dt;
            }
        }
        printf("%-5s %5d %11.1f %14s %16s %20s %9s\n", t.name, 1, 1e6 * best[0], "1.00x", "-", "-", "-");
        for (int c = 1; c < 5; c++) {
            const double more = (best[c] - best[c - 1]) / (counts[c] - counts[c - 1]);  // from the count above
            const double per_multiply = more / units / t.multiplies;
            printf("%-5s %5d %11.1f %13.2fx %16.1f %20.3f %8.0f%%\n", t.name, counts[c], 1e6 * best[c],
                   best[c] / best[0], 1e6 * more, 1e9 * per_multiply, 100 * mul / per_multiply);
        }
    }
    return 0;
}
