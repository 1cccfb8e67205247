// run_attention for float inputs, over a cache of float or float8 e4m3 (attention_kernels.cuh):
// one file per input dtype so that nvcc compiles the three in parallel.
#include "attention_kernels.cuh"

namespace pagedjax {
namespace attention_impl {

PAGEDJAX_RUN_ATTENTION(float, float)
PAGEDJAX_RUN_ATTENTION(float, fp8_t)

}  // namespace attention_impl
}  // namespace pagedjax
