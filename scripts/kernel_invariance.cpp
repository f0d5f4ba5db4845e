// Kernel-level batch invariance of the patched ggml CPU backend (scripts/patches/ggml-cpu-batch-invariant.patch),
// with no model and no Python: for each weight type, with plain and repacked weights, a mul_mat of n = 1..17
// activation columns must give every column bit for bit what a one-column mul_mat gives with the patch off (the
// kernels one-token decoding runs). Built for a foreign CPU and run under qemu-user by scripts/kernel_invariance.sh,
// so the ARM kernels are checked on an x86 machine; it runs natively too.
//   kernel_invariance [--stock]   --stock computes the n-column passes with the patch off: expected to differ
// Prints one line per case and exits 1 if any case differs, or if repacked weights compute other values than plain ones.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int64_t K = 1024;      // the dot products' length: four Q*_K super-blocks
constexpr int64_t M = 96;        // weight rows: a multiple of 8 and 4, so every repacked layout applies
constexpr int     MAX_N = 17;    // the longest verify pass the runtime sends (K + 1 = 17)

struct Weights {
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * w = nullptr;
    ~Weights() {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
    }
};

ggml_backend_buffer_type_t repack_buffer_type() {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        reg, "ggml_backend_dev_get_extra_bufts");
    if (!get_extra) return nullptr;
    for (ggml_backend_buffer_type_t * t = get_extra(ggml_backend_reg_dev_get(reg, 0)); t && *t; ++t) {
        if (strcmp(ggml_backend_buft_name(*t), "CPU_REPACK") == 0) return *t;
    }
    return nullptr;
}

// the output of W (M x K) times the first n columns of x (K floats each): n columns of M floats
std::vector<float> mul_mat(ggml_backend_t backend, ggml_tensor * w, const std::vector<float> & x, int n) {
    ggml_init_params params = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, n);
    ggml_tensor * y = ggml_mul_mat(ctx, w, a);
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_backend_tensor_set(a, x.data(), 0, sizeof(float) * K * n);
    if (ggml_backend_graph_compute(backend, graph) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph compute failed\n");
        exit(2);
    }
    std::vector<float> out(M * n);
    ggml_backend_tensor_get(y, out.data(), 0, sizeof(float) * M * n);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return out;
}

}  // namespace

int main(int argc, char ** argv) {
    const bool stock = argc > 1 && strcmp(argv[1], "--stock") == 0;
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, 2);
    ggml_backend_buffer_type_t repack = repack_buffer_type();

    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> w_f32(M * K), x(K * MAX_N);
    for (float & v : w_f32) v = normal(rng) * 0.05f;
    for (float & v : x) v = normal(rng);

    const ggml_type types[] = {GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K,
                               GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_F16,  GGML_TYPE_F32};
    int failures = 0;
    for (ggml_type type : types) {
        std::vector<float> plain_reference;  // the plain weights' one-column outputs: repacked kernels must agree
        std::vector<uint8_t> q(ggml_row_size(type, K) * M);
        ggml_quantize_chunk(type, w_f32.data(), q.data(), 0, M, K, nullptr);
        for (int repacked = 0; repacked < 2; ++repacked) {
            if (repacked && !repack) continue;
            Weights weights;
            ggml_init_params params = {ggml_tensor_overhead() * 2, nullptr, true};
            weights.ctx = ggml_init(params);
            weights.w = ggml_new_tensor_2d(weights.ctx, type, K, M);
            weights.buf = ggml_backend_alloc_ctx_tensors_from_buft(
                weights.ctx, repacked ? repack : ggml_backend_cpu_buffer_type());
            if (repacked && weights.w->extra == nullptr) {
                continue;  // no repacked layout for this type on this CPU (llama.cpp keeps such weights plain)
            }
            ggml_backend_tensor_set(weights.w, q.data(), 0, q.size());

            // one-token decoding: each column alone, the patch off
            ggml_cpu_set_batch_invariant(false);
            std::vector<float> reference(M * MAX_N);
            for (int c = 0; c < MAX_N; ++c) {
                std::vector<float> col(x.begin() + c * K, x.begin() + (c + 1) * K);
                std::vector<float> y = mul_mat(backend, weights.w, col, 1);
                std::copy(y.begin(), y.end(), reference.begin() + c * M);
            }

            // a repacked layout computes the same products in another order: equal up to float rounding
            float layout_diff = 0, scale = 0;
            if (repacked) {
                for (size_t i = 0; i < reference.size(); ++i) {
                    layout_diff = std::max(layout_diff, std::fabs(reference[i] - plain_reference[i]));
                    scale = std::max(scale, std::fabs(plain_reference[i]));
                }
            } else {
                plain_reference = reference;
            }
            const bool layout_wrong = layout_diff > 1e-5f * scale;

            ggml_cpu_set_batch_invariant(!stock);
            int bad_n = 0;
            float max_diff = 0;
            for (int n = 1; n <= MAX_N; ++n) {
                std::vector<float> y = mul_mat(backend, weights.w, x, n);
                bool same = memcmp(y.data(), reference.data(), sizeof(float) * M * n) == 0;
                if (!same) {
                    ++bad_n;
                    for (int64_t i = 0; i < M * n; ++i) {
                        max_diff = std::max(max_diff, std::fabs(y[i] - reference[i]));
                    }
                }
            }
            printf("%-5s %-8s n=1..%d: %s", ggml_type_name(type),
                   repacked ? "repacked" : "plain", MAX_N,
                   bad_n ? "DIFFERS" : "bit-identical");
            if (bad_n) printf(" (%d of %d passes, max |diff| %g)", bad_n, MAX_N, max_diff);
            if (repacked) printf("; vs plain weights max |diff| %.1e of %.1e%s", layout_diff, scale, layout_wrong ? ": WRONG" : "");
            printf("\n");
            failures += bad_n > 0 || layout_wrong;
        }
    }
    ggml_backend_free(backend);
    printf("%s\n", failures ? "FAIL" : "PASS");
    return failures ? 1 : 0;
}
