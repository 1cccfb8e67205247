// Greedy verification of a speculative step's drafts as one torch CPU op: what
// backends/torch/rejection_sampler.py computes for greedy rows without logit entries (its ~18
// small ops, ~0.3 ms of a batch-1 step on a CPU, are this one loop).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace pagedjax {
namespace {

constexpr int32_t kPlaceholder = -1;  // rejection_sampler.py's PLACEHOLDER_TOKEN_ID

// target_argmax [L, K+1] int32: the target's argmax at each draft position and the bonus one;
// draft_token_ids [L, K] int32; num_draft_tokens [L] int32 in [0, K]. A row accepts its drafts
// while they equal the target's argmax, then takes the argmax after them (recovered or bonus).
// → (output_token_ids [L, K+1] int32: accepted, the next token, then -1; num_accepted [L] int32)
std::tuple<at::Tensor, at::Tensor> rejection_greedy_sample_cpu(const at::Tensor& target_argmax,
                                                              const at::Tensor& draft_token_ids,
                                                              const at::Tensor& num_draft_tokens) {
  const char* op = "pagedjax::rejection_greedy_sample";
  TORCH_CHECK(draft_token_ids.scalar_type() == at::kInt && draft_token_ids.dim() == 2, op,
              ": draft_token_ids must be int32 [L, K], got ", draft_token_ids.scalar_type(), " ",
              draft_token_ids.sizes());
  const int64_t L = draft_token_ids.size(0), K = draft_token_ids.size(1);
  TORCH_CHECK(target_argmax.scalar_type() == at::kInt && target_argmax.dim() == 2 &&
                  target_argmax.size(0) == L && target_argmax.size(1) == K + 1,
              op, ": target_argmax must be int32 [", L, ", ", K + 1, "], got ",
              target_argmax.scalar_type(), " ", target_argmax.sizes());
  TORCH_CHECK(num_draft_tokens.scalar_type() == at::kInt && num_draft_tokens.dim() == 1 &&
                  num_draft_tokens.size(0) == L,
              op, ": num_draft_tokens must be int32 [", L, "], got ",
              num_draft_tokens.scalar_type(), " ", num_draft_tokens.sizes());
  const at::Tensor argmax = target_argmax.contiguous(), drafts = draft_token_ids.contiguous();
  const at::Tensor counts = num_draft_tokens.contiguous();
  at::Tensor out = at::full({L, K + 1}, kPlaceholder, argmax.options());
  at::Tensor accepted = at::empty({L}, argmax.options());
  const int32_t *a = argmax.data_ptr<int32_t>(), *d = drafts.data_ptr<int32_t>();
  const int32_t* n = counts.data_ptr<int32_t>();
  int32_t *o = out.data_ptr<int32_t>(), *acc = accepted.data_ptr<int32_t>();
  for (int64_t l = 0; l < L; ++l) {
    const int32_t* row_argmax = a + l * (K + 1);
    const int32_t* row_drafts = d + l * K;
    int32_t* row_out = o + l * (K + 1);
    int64_t j = 0;
    while (j < K && j < n[l] && row_drafts[j] == row_argmax[j]) {
      row_out[j] = row_drafts[j];
      ++j;
    }
    row_out[j] = row_argmax[j];
    acc[l] = static_cast<int32_t>(j);
  }
  return {out, accepted};
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def(
      "rejection_greedy_sample(Tensor target_argmax, Tensor draft_token_ids, "
      "Tensor num_draft_tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) {
  m.impl("rejection_greedy_sample", &pagedjax::rejection_greedy_sample_cpu);
}
