#include "apis/comm.h"

#include <c10/util/Exception.h>

namespace mok::apis {

std::vector<std::string> moe_comm_fields() {
  return {
#define MOK_COMM_NAME(name, meaning) #name,
      MOK_COMM_FIELDS(MOK_COMM_NAME)
#undef MOK_COMM_NAME
  };
}

launch::MoeComm comm_of(at::IntArrayRef c) {
  TORCH_CHECK(c.size() == kCommNumFields, "mok::moe: comm must hold ", kCommNumFields,
              " ints (mok_megatron.ops.moe.make_comm builds it), got ", c.size());
  launch::MoeComm comm;
  comm.peer_bases = reinterpret_cast<const uint64_t*>(c[kComm_peer_bases]);
  comm.signal_pads = reinterpret_cast<const uint64_t*>(c[kComm_signal_pads]);
  comm.my_base = static_cast<uint64_t>(c[kComm_my_base]);
  comm.rank = static_cast<int>(c[kComm_rank]);
  comm.lay = layout::WorkspaceLayout{c[kComm_num_ranks], c[kComm_max_tokens], c[kComm_topk],
                                     c[kComm_hidden],    c[kComm_slot_rows],  c[kComm_counter_words]};
  comm.timeout_ns = c[kComm_timeout_ms] * 1000000;
  comm.error_record = reinterpret_cast<int32_t*>(c[kComm_error_record]);
  comm.chained = c[kComm_chained] != 0;
  TORCH_CHECK(comm.peer_bases != nullptr && comm.my_base != 0, "mok::moe: null workspace");
  TORCH_CHECK(comm.lay.num_ranks == 1 || comm.signal_pads != nullptr,
              "mok::moe: more than one rank needs signal pads");
  TORCH_CHECK(comm.rank >= 0 && comm.rank < comm.lay.num_ranks, "mok::moe: rank ", comm.rank,
              " outside [0, ", comm.lay.num_ranks, ")");
  TORCH_CHECK(comm.lay.hidden % 8 == 0, "mok::moe: hidden=", comm.lay.hidden,
              " must be a multiple of 8 (16-byte rows)");
  TORCH_CHECK(comm.timeout_ns > 0, "mok::moe: timeout_ms must be positive");
  return comm;
}

}  // namespace mok::apis
