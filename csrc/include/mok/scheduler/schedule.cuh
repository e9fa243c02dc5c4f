// The deterministic routed schedule on the device, in four kernels; integer-for-integer equal to
// mok_megatron.functional.schedule.build_schedule_from_global (see its docstring for each field).
//
// A "slot" is one flat entry i = (s * T + t) * K + k of the gathered routing [W, T, K]. Rows are
// the slots routed to this rank's experts, sorted by (local expert, i): a stable counting sort.
//   count_chunks:  per chunk of kChunk slots, rows per local expert and slots per rank
//   scan_chunks:   (one block) expert offsets, each chunk's first row per expert, error flags
//   place_rows:    each slot's row = chunk base + rank among equal experts earlier in its chunk
//   count_tokens:  per chunk of kTokenChunk tokens, the tokens that send a slot here
//   place_tokens:  received tokens in (s, t) order (chunk base + rank in chunk), token_rows
//   place_token_rows: (grid-stride) row_token_idx and send_to, from place_tokens' token_pos
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "mok/common/macros.cuh"
#include "mok/common/ptx.cuh"
#include "mok/scheduler/params.cuh"

namespace mok::scheduler {

// Grid: num_chunks blocks of kChunk threads; dynamic shared memory (E_l + W + 1) ints.
__global__ void count_chunks(ScheduleParams p) {
  ptx::chain_begin();  // launch/chain.h
  extern __shared__ int smem[];
  int* s_expert = smem;
  int* s_rank = smem + p.num_local_experts;
  int* s_bad = s_rank + p.num_ranks;
  for (int i = threadIdx.x; i < p.num_local_experts + p.num_ranks + 1; i += blockDim.x) smem[i] = 0;
  __syncthreads();
  const int i = blockIdx.x * kChunk + threadIdx.x;
  if (i < p.num_slots()) {
    const int64_t id = p.global_topk[i];
    if (id < -1 || id >= p.num_experts) atomicOr(s_bad, 1);
    if (id >= 0 && id < p.num_experts) atomicAdd(&s_rank[id / p.num_local_experts], 1);
    const int e = p.local_expert(id);
    if (e >= 0) atomicAdd(&s_expert[e], 1);  // NOTE: integer counts; order does not matter
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_local_experts; e += blockDim.x) {
    p.chunk_expert_rows[blockIdx.x * p.num_local_experts + e] = s_expert[e];
  }
  for (int d = threadIdx.x; d < p.num_ranks; d += blockDim.x) {
    p.chunk_rank_slots[blockIdx.x * p.num_ranks + d] = s_rank[d];
  }
  if (threadIdx.x == 0) p.chunk_bad[blockIdx.x] = *s_bad;
}

// Grid: one block of kTokenThreads threads.
// NOTE: the chunk counts are read kScanBatch at a time before any store and the experts' rows
// are scanned by cub's BlockScan (thread 0 summed them one by one before): at 8192 tokens that
// took deepseek-v3's 256 experts from 33 to 23 us and left qwen3-30b-a3b's 128 at 21 us
// (profile_moe at 2defa24 and edf94f1). What remained was each thread's walk over all 256 chunks
// (65536 slots / kChunk) with 128 or 256 of the 1024 threads busy, and one thread's walk over
// them for each rank's total. Now the threads not over an expert take the chunks in groups (see
// scan_chunks), and a warp per rank sums that rank's column. Integer sums: the same values in any
// order.
// NOTE: a warp per expert with its lanes over the chunks was built (4cad4e2): right (the
// schedule tests passed on the H200) and three to seven times slower (71 us on qwen3-30b-a3b,
// 157 on deepseek-v3: profile_moe_h200_ep1_4cad4e2.json). Its lanes read chunk_expert_rows with
// a stride of E_l ints, a sector each, and one SM's load throughput bounds the kernel; the lanes
// must stay over the experts (coalesced), with the warps splitting the chunks between them.
constexpr int kScanBatch = 8;

// count[j] = expert e's rows in chunk b0 + j of chunk_expert_rows [num_chunks, e_l] (0 at or past
// chunk `end`): kScanBatch loads issued before any is used.
MOK_DEVICE void load_chunk_counts(const int* chunk_expert_rows, int end, int e_l, int b0, int e,
                                  int (&count)[kScanBatch]) {
#pragma unroll
  for (int j = 0; j < kScanBatch; ++j) {
    count[j] = b0 + j < end ? chunk_expert_rows[(b0 + j) * e_l + e] : 0;
  }
}

// The threads of scan_chunks over experts and chunks: `width` experts at a time (E_l rounded up
// to whole warps, at most the block), the block's threads in `groups` of `width`, group g over
// chunks [g * per_group, (g + 1) * per_group). qwen3-30b-a3b's 128 experts: 8 groups of 32 of
// the 256 chunks at 8192 tokens; deepseek-v3's 256: 4 of 64. From 513 experts the block is one
// group (520: 544 wide, 480 threads idle); past 1024, one group over the experts in passes.
struct ScanGroups {
  int width, groups, per_group;
  MOK_DEVICE ScanGroups(int e_l, int num_chunks) {
    const int warps = (max(e_l, 1) + 31) / 32;  // no experts: one idle warp's width
    width = warps * 32 < kTokenThreads ? warps * 32 : kTokenThreads;
    groups = kTokenThreads / width;
    per_group = (num_chunks + groups - 1) / groups;
  }
};

__global__ void __launch_bounds__(kTokenThreads) scan_chunks(ScheduleParams p) {
  ptx::chain_begin();  // launch/chain.h
  using BlockScan = cub::BlockScan<int64_t, kTokenThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int s_flags;
  __shared__ int s_part[kTokenThreads];     // [group][expert of the pass]: rows in its chunks
  __shared__ int64_t s_start[kTokenThreads];  // [expert of the pass]: its first row
  const int num_chunks = p.num_chunks(), e_l = p.num_local_experts;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  if (tid == 0) s_flags = 0;
  __syncthreads();
  for (int d = warp; d < p.num_ranks; d += kTokenThreads / 32) {  // a warp per rank's column
    int64_t total = 0;
    for (int b = lane; b < num_chunks; b += 32) total += p.chunk_rank_slots[b * p.num_ranks + d];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0 && total > p.row_capacity) atomicOr(&s_flags, kErrRowOverflow);
  }
  for (int b = tid; b < num_chunks; b += kTokenThreads) {
    if (p.chunk_bad[b]) atomicOr(&s_flags, kErrExpertId);
  }
  // Experts [base, base + width) at a time. Thread (g, i) sums expert base + i's counts over
  // group g's chunks (read in batches) into s_part; group 0's threads add their expert's parts,
  // and the block scans them (the other groups' threads, after group 0's in thread order, give
  // 0) after the carry of the experts before; then each thread turns its chunks' counts into
  // running starts in place, from its expert's start plus the earlier groups' parts.
  const ScanGroups sg(e_l, num_chunks);
  const int g = tid / sg.width, i = tid % sg.width;
  const int first = g * sg.per_group;
  const int end = first + sg.per_group < num_chunks ? first + sg.per_group : num_chunks;
  int64_t carry = 0;
  for (int base = 0; base < e_l; base += sg.width) {
    const int e = base + i;
    const bool mine = g < sg.groups && e < e_l;
    int part = 0;  // int fits: rows <= W * T * K
    if (mine) {
      for (int b0 = first; b0 < end; b0 += kScanBatch) {
        int count[kScanBatch];
        load_chunk_counts(p.chunk_expert_rows, end, e_l, b0, e, count);
#pragma unroll
        for (int j = 0; j < kScanBatch; ++j) part += count[j];
      }
    }
    if (g < sg.groups) s_part[tid] = part;
    __syncthreads();
    int64_t rows = 0;
    if (g == 0 && e < e_l) {
      for (int h = 0; h < sg.groups; ++h) rows += s_part[h * sg.width + i];
    }
    int64_t start, block_rows;
    BlockScan(scan_storage).ExclusiveSum(rows, start, block_rows);
    start += carry;
    carry += block_rows;
    if (g == 0 && e < e_l) {
      p.expert_offsets[e] = start;  // uncapped for now
      s_start[i] = start;
    }
    __syncthreads();
    if (mine) {
      int running = static_cast<int>(s_start[i]);  // int fits: rows <= W * T * K
      for (int h = 0; h < g; ++h) running += s_part[h * sg.width + i];
      for (int b0 = first; b0 < end; b0 += kScanBatch) {
        int count[kScanBatch];
        load_chunk_counts(p.chunk_expert_rows, end, e_l, b0, e, count);
#pragma unroll
        for (int j = 0; j < kScanBatch; ++j) {
          if (b0 + j < end) p.chunk_expert_rows[(b0 + j) * e_l + e] = running;
          running += count[j];
        }
      }
    }
    __syncthreads();  // s_part, s_start and scan_storage are reused by the next experts
  }
  if (threadIdx.x == 0) {
    p.expert_offsets[e_l] = carry;
    p.num_rows[0] = carry;
    p.error_flags[0] = s_flags;
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= e_l; e += blockDim.x) {
    const int64_t cap = p.row_capacity;
    p.expert_offsets[e] = p.expert_offsets[e] < cap ? p.expert_offsets[e] : cap;
  }
}

// Grid: num_chunks blocks of kChunk threads. Rows arrays must be pre-filled as unused.
__global__ void place_rows(ScheduleParams p) {
  ptx::chain_begin();  // launch/chain.h
  __shared__ int s_expert[kChunk];
  const int i = blockIdx.x * kChunk + threadIdx.x;
  const int e = i < p.num_slots() ? p.local_expert(p.global_topk[i]) : -1;
  s_expert[threadIdx.x] = e;
  __syncthreads();
  if (i >= p.num_slots()) return;
  int row = -1;
  if (e >= 0) {
    int earlier = 0;  // equal experts earlier in this chunk: keeps the sort stable
    for (int j = 0; j < static_cast<int>(threadIdx.x); ++j) earlier += s_expert[j] == e;
    row = p.chunk_expert_rows[blockIdx.x * p.num_local_experts + e] + earlier;
    if (row < p.row_capacity) {
      const int per_rank = p.max_tokens * p.topk;
      p.row_expert[row] = e;
      p.row_src_rank[row] = i / per_rank;
      p.row_src_token[row] = (i / p.topk) % p.max_tokens;
      p.row_src_slot[row] = i % p.topk;
    } else {
      row = -1;
    }
  }
  p.slot_row[i] = row;
}

// Whether token i = s * T + t sends a slot here (after place_rows).
MOK_DEVICE bool received(const ScheduleParams& p, int i) {
  bool here = false;
  for (int k = 0; i < p.num_tokens() && k < p.topk; ++k) here |= p.slot_row[i * p.topk + k] >= 0;
  return here;
}

// Grid: num_token_chunks blocks of kTokenChunk threads: received tokens per chunk.
__global__ void count_tokens(ScheduleParams p) {
  ptx::chain_begin();  // launch/chain.h
  using BlockReduce = cub::BlockReduce<int, kTokenChunk>;
  __shared__ typename BlockReduce::TempStorage storage;
  const int here = received(p, blockIdx.x * kTokenChunk + threadIdx.x) ? 1 : 0;
  const int total = BlockReduce(storage).Sum(here);
  if (threadIdx.x == 0) p.chunk_tokens[blockIdx.x] = total;
}

// Grid: num_token_chunks blocks of kTokenChunk threads (after count_tokens): received tokens in
// (s, t) order, token_rows; each block starts at the sum of the chunks before it.
__global__ void place_tokens(ScheduleParams p) {
  ptx::chain_begin();  // launch/chain.h
  using BlockScan = cub::BlockScan<int, kTokenChunk>;
  using BlockReduce = cub::BlockReduce<int, kTokenChunk>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ int s_base;
  const int b = static_cast<int>(blockIdx.x), k_n = p.topk;
  int before = 0, all = 0;
  for (int c = threadIdx.x; c < p.num_token_chunks(); c += blockDim.x) {
    const int n = p.chunk_tokens[c];
    before += c < b ? n : 0;
    all += n;
  }
  const int base = BlockReduce(reduce_storage).Sum(before);
  if (threadIdx.x == 0) s_base = base;
  __syncthreads();  // reduce_storage is reused
  const int total = BlockReduce(reduce_storage).Sum(all);  // valid in thread 0 only
  const int i = b * kTokenChunk + threadIdx.x;
  const bool here = received(p, i);
  int pos;
  BlockScan(scan_storage).ExclusiveSum(here ? 1 : 0, pos);
  pos += s_base;
  if (i < p.num_tokens()) {
    p.token_pos[i] = here ? pos : -1;
    const bool kept = here && pos < p.token_capacity;
    p.recv_token_pos[i] = kept ? pos : -1;
    if (kept) {
      p.recv_token_src[pos] = i;
      for (int k = 0; k < k_n; ++k) p.token_rows[pos * k_n + k] = p.slot_row[i * k_n + k];
    }
  }
  __shared__ int s_num_recv;
  if (threadIdx.x == 0) {
    s_num_recv = total < p.token_capacity ? total : p.token_capacity;
    if (b == 0) p.num_recv_tokens[0] = s_num_recv;
  }
  __syncthreads();
  // The unused tail [num_recv, token_capacity), shared by the blocks.
  for (int j = s_num_recv + i; j < p.token_capacity; j += gridDim.x * kTokenChunk) {
    p.recv_token_src[j] = -1;
    for (int k = 0; k < k_n; ++k) p.token_rows[j * k_n + k] = -1;
  }
}

// Grid-stride over max(row_capacity, max_tokens) (after place_tokens: token_pos is complete).
__global__ void place_token_rows(ScheduleParams p) {
  ptx::chain_begin();  // launch/chain.h
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t row = first; row < p.row_capacity; row += stride) {
    const int64_t s = p.row_src_rank[row];
    p.row_token_idx[row] = s >= 0 ? p.token_pos[s * p.max_tokens + p.row_src_token[row]] : -1;
  }
  const int k_n = p.topk;
  const int64_t* mine = p.global_topk + static_cast<int64_t>(p.rank) * p.max_tokens * k_n;
  for (int64_t t = first; t < p.max_tokens; t += stride) {
    for (int d = 0; d < p.num_ranks; ++d) {
      bool visits = false;
      for (int k = 0; k < k_n; ++k) {
        const int64_t id = mine[t * k_n + k];
        visits |= id >= 0 && id < p.num_experts && id / p.num_local_experts == d;
      }
      p.send_to[t * p.num_ranks + d] = visits;
    }
  }
}

// Grid-stride: mark every row unused (row_expert = E_l, the rest -1).
__global__ void init_rows(ScheduleParams p) {
  ptx::chain_begin();  // launch/chain.h
  for (int row = blockIdx.x * blockDim.x + threadIdx.x; row < p.row_capacity;
       row += gridDim.x * blockDim.x) {
    p.row_expert[row] = p.num_local_experts;
    p.row_src_rank[row] = -1;
    p.row_src_token[row] = -1;
    p.row_src_slot[row] = -1;
  }
}

}  // namespace mok::scheduler
