// `comm`: the int[] every collective mok::moe_* op takes, naming one rank's symmetric workspace.
// Its fields are defined once, here (MOK_COMM_FIELDS); Python reads their names through
// mok::moe_comm_fields and builds the list by name (mok_megatron/ops/moe.py, make_comm).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "launch/moe.h"

// X(name, meaning)
#define MOK_COMM_FIELDS(X)                                                                   \
  X(peer_bases, "device address of the [W] uint64 table of every rank's workspace base")    \
  X(signal_pads, "device address of the [W] uint64 table of signal pads (0 for one rank)")  \
  X(my_base, "device address of this rank's workspace")                                      \
  X(rank, "this rank in the expert-parallel group")                                          \
  X(num_ranks, "W, the expert-parallel size")                                                \
  X(max_tokens, "T_max, the most local tokens a pass takes")                                 \
  X(topk, "K, routed slots per token")                                                       \
  X(hidden, "H, the hidden size")                                                            \
  X(slot_rows, "1 when the layout has the megakernel's slot_rows region")                    \
  X(counter_words, "int32 words of the layout's counters region")                            \
  X(timeout_ms, "every device-side wait gives up after this long")                           \
  X(error_record, "address of the megakernel's pinned int32 error record (0: none)")       \
  X(chained, "1: the pass's kernels launch chained (MoKConfig.chained_launches)")

namespace mok::apis {

enum CommField : int {
#define MOK_COMM_ENUM(name, meaning) kComm_##name,
  MOK_COMM_FIELDS(MOK_COMM_ENUM)
#undef MOK_COMM_ENUM
      kCommNumFields
};

// The field names in order.
std::vector<std::string> moe_comm_fields();

// Checks the list and turns it into the launchers' MoeComm.
launch::MoeComm comm_of(at::IntArrayRef comm);

}  // namespace mok::apis
