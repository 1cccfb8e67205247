// run_attention for c10::Half inputs, over a cache of c10::Half or float8 e4m3 (attention_kernels.cuh):
// one file per input dtype so that nvcc compiles the three in parallel.
#include "attention_kernels.cuh"

namespace pagedjax {
namespace attention_impl {

PAGEDJAX_RUN_ATTENTION(c10::Half, c10::Half)
PAGEDJAX_RUN_ATTENTION(c10::Half, fp8_t)

}  // namespace attention_impl
}  // namespace pagedjax
