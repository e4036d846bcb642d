// Packed sequences: several documents (sft records) share one row of seq_len tokens, each attending
// only to itself, its positions counted from 0. The input carries its layout in band, so a model's
// forward still takes one tensor and every plugin, sampler and loader moves it as it moves any input.
//
// Note [Packed sequences]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A packed input is int64 [B, 2, T]: row 0 the token ids, row 1 each token's document id (any integers;
// a document is a run of equal ids, so the ids of neighbouring documents differ). pack_sequences makes
// it, unpack_sequences splits it into the ids [B, T] and a SequenceLayout: the document ids (the
// attention op's `segments`: a query attends only keys of its own document, Note [Attention masks] in
// ops/nn_functional.cpp) and each token's position within its document (0 at a document's first token),
// which the rotary embedding turns by (the GPT's learned position embeddings are looked up at it). A
// model that knows packing (the Llama family: llama, mistral, qwen2; the GPT) unpacks its input and
// holds the layout in a SequenceLayoutScope for the length of its forward, where its attention layers
// read it (current_sequence_layout()); so a document's logits are those it
// has alone, and a packed batch's loss over the global batch's targets (Note [The token mean of a
// global batch] in booster/trainer/trainer.cpp) is that of its documents one by one. The scope is
// thread-local and lasts one forward. Two things run a model's layers outside it: activation
// checkpointing, whose recompute runs in backward (the checkpoint keeps the layout it ran under and
// installs it again, Note [Recomputing in backward]), and pipeline stages after the first, which see
// hidden states only (their PipelineStage installs the micro-batch's layout from the batch every stage
// is handed, Note [Packed micro-batches] in pipeline.cpp).
#pragma once

#include <utility>

#include "booster/tensor/tensor.h"

namespace booster::nn {

class RotaryEmbedding;

struct SequenceLayout {
  Tensor segments;   // int64 [B, T] document ids
  Tensor positions;  // int64 [B, T] positions within the document
};

// ids and segments int64 [B, T] (or [T]) -> the packed input [B, 2, T] (or [2, T]).
Tensor pack_sequences(const Tensor& ids, const Tensor& segments);
// Whether x is a packed input: an integer [B, 2, T] tensor.
bool is_packed(const Tensor& x);
// The ids [B, T] and layout of a packed input, on its device. ShapeError when x is not one.
std::pair<Tensor, SequenceLayout> unpack_sequences(const Tensor& x);

// The layout of the packed batch whose forward runs on this thread; null outside one.
const SequenceLayout* current_sequence_layout();
class SequenceLayoutScope {
 public:
  explicit SequenceLayoutScope(SequenceLayout layout);
  ~SequenceLayoutScope();
  SequenceLayoutScope(const SequenceLayoutScope&) = delete;
  SequenceLayoutScope& operator=(const SequenceLayoutScope&) = delete;

 private:
  SequenceLayout layout_;
  const SequenceLayout* previous_;
};

// x [B, T, H, head_dim] rotated by the rotary embedding at per-token positions [B, T] (RotaryEmbedding::
// apply with the angles of each token's own position).
Tensor rotate_at_positions(RotaryEmbedding& rotary, const Tensor& x, const Tensor& positions);

}  // namespace booster::nn
