// run_attention for c10::BFloat16 inputs, over a cache of c10::BFloat16 or float8 e4m3 (attention_kernels.cuh):
// one file per input dtype so that nvcc compiles the three in parallel.
#include "attention_kernels.cuh"

namespace pagedjax {
namespace attention_impl {

PAGEDJAX_RUN_ATTENTION(c10::BFloat16, c10::BFloat16)
PAGEDJAX_RUN_ATTENTION(c10::BFloat16, fp8_t)

}  // namespace attention_impl
}  // namespace pagedjax
