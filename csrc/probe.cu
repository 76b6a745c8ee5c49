// The data-path probe, run once when a workspace is created, before its first call.
// Its places cover every area a transport writes or reads remotely: push's slots, pull's areas and the flags
// (write rounds), and pull's areas again as its consumers load them (read rounds).
//
// cudaDeviceCanAccessPeer says what the driver allows, not what the PCIe fabric delivers: with ACS redirection
// on a switch or a translating IOMMU, peer writes can be dropped or land elsewhere while the capability still
// says yes, and the first forward of a server would then die in a timeout (I7). A mapping can also be broken
// for part of a slab only. So every rank writes pattern packs to every peer through the very path the kernels
// use, at the edges of every area the kernels write: in each parity region, the first and last pack of every
// one-shot slot, of every chunk-sized block (the reduce-scatter, cross-island and all-gather slots are made of
// those), and the end of the region. It then waits, bounded and without trapping, for every peer's packs in
// its own slab. Islands need no separate pass: every rank writes to every peer, across islands too.
//
// Pull moves its data by peer loads, which carry no sentinels: a broken read path returns garbage (or, after a
// PCIe completion timeout, all ones) that pull would sum as data. So the read rounds, one per parity, have every
// rank stage pattern packs in its own pull area and load every peer's with the loads pull uses, at the first and
// last pack of each part of the area pull addresses: the input copy, the two partial planes and the result.
//
// Rounds: within one round the places of different senders never overlap; across rounds they may (a chunk
// block can start where a one-shot slot does, a read place where a write round's pull place was), so the host
// separates rounds by a group barrier, and a round's places are empty again before the next round starts.
//
// Invariants kept: the places are empty before (I1: the slab was just filled, no call has run) and after (the
// waiter empties what it read, I4; a reader empties the read place it loaded), so the first real call finds
// clean scratch. A probe that fails leaves the workspace unused: the host tears it down.
//
// Invariants of the read rounds (relied on by probe_read_kernel below):
//  R1  The read places follow pull's layout of one parity's area (transports/pull.cuh, PullOneShot and
//      PullHier): [input copy: pull_input_bytes][partial plane 0: chunk][partial plane 1: chunk][result: chunk].
//      A change there must change read_part_offset / read_part_bytes here.
//  R2  Every reader has places of its own in every owner's area: reader position j = (reader - owner - 1) mod W
//      sits j packs in from each end of each part, so a reader can empty what it loaded without disturbing
//      another reader, and no host barrier is needed between staging and loading. The parts hold at least
//      2 (W - 1) packs (the input copy is a multiple of 256 B, a chunk a multiple of kOwnerBlockPacks packs):
//      workspace_probe checks it.
//  R3  The owner stages with local stores; a reader polls the peer's place with pull's own load (load_volatile,
//      a system-scope strong load) until its pattern shows up, bounded by the probe's timeout and backing off
//      between misses, as host-memory polls do (I13), since every miss here crosses PCIe. It never traps.
//  R4  A place reads as the empty fill until the owner's pack lands. A reader that saw its pattern passes; one
//      that saw anything else but the fill (garbage, another owner's or another place's pack) reports wrong data,
//      one that saw only the fill reports the pattern missing. Only a reader that saw its pattern empties the
//      place: a place never seen may still receive the owner's pack, and the workspace is torn down then anyway.
#include <algorithm>

#include "ar_launch.h"
#include "ar_protocol.cuh"

namespace sgl_sm120 {
namespace {

// The rounds of one parity: one-shot slots, then the chunk blocks W at a time, then the push region's end, the
// pull area's ends (transports/pull.cuh), and the flag area's ends (one area holds the flags of both call parities,
// ar_types.h: its first and last pack are probed with each parity alike).
__host__ __device__ __forceinline__ long long chunk_blocks(const WorkspaceView& v) {
  return v.chunk_slot_bytes > 0 ? v.region_bytes / v.chunk_slot_bytes : 0;
}
__host__ __device__ __forceinline__ int chunk_rounds(const WorkspaceView& v) {
  return static_cast<int>((chunk_blocks(v) + v.world - 1) / v.world);
}
__host__ __device__ __forceinline__ int rounds_per_parity(const WorkspaceView& v) { return 4 + chunk_rounds(v); }

// The round's kind within its parity.
enum ProbeArea : int { kAreaOneShot, kAreaChunks, kAreaRegionEnd, kAreaPull, kAreaFlags };
__host__ __device__ __forceinline__ int area_of(const WorkspaceView& v, int round) {
  const int k = round % rounds_per_parity(v);
  if (k == 0) return kAreaOneShot;
  if (k <= chunk_rounds(v)) return kAreaChunks;
  return kAreaRegionEnd + (k - 1 - chunk_rounds(v));
}

// The slab offset of place `which` (0: first, 1: last) that `sender` writes in `round`, or -1. Different senders'
// places never overlap within a round.
__host__ __device__ __forceinline__ long long probe_place(const WorkspaceView& v, int round, int sender, int which) {
  const int per = rounds_per_parity(v);
  const int parity = round / per;
  const long long region = kRegionsOffset + parity * v.region_bytes;
  long long first, last;
  switch (area_of(v, round)) {
    case kAreaOneShot:
      first = region + sender * v.oneshot_slot_bytes;
      last = first + v.oneshot_slot_bytes - kPackBytes;
      break;
    case kAreaChunks: {
      const long long block = static_cast<long long>(round % per - 1) * v.world + sender;
      if (block >= chunk_blocks(v)) return -1;
      first = region + block * v.chunk_slot_bytes;
      last = first + v.chunk_slot_bytes - kPackBytes;
      break;
    }
    case kAreaRegionEnd:
      first = last = region + v.region_bytes - static_cast<long long>(sender + 1) * kPackBytes;
      break;
    case kAreaPull: {
      const long long pull = v.pull_offset + parity * v.pull_region_bytes;
      first = pull + sender * kPackBytes;
      last = pull + v.pull_region_bytes - static_cast<long long>(sender + 1) * kPackBytes;
      break;
    }
    default:  // kAreaFlags
      first = kCtrlBytes + sender * kPackBytes;
      last = kCtrlBytes + kFlagBytes - static_cast<long long>(sender + 1) * kPackBytes;
      break;
  }
  if (which == 1 && last == first) return -1;
  return which == 0 ? first : last;
}

// No half-word is kEmptyHalf (I2), and the pack names sender, receiver, round and place, so a write that lands in
// the wrong slab or place is caught, not only one that never lands.
__device__ __forceinline__ uint4 probe_pattern(int sender, int receiver, int round, int which) {
  return make_uint4(0x31000000u | (static_cast<uint32_t>(sender) << 8) | static_cast<uint32_t>(receiver),
                    0x52000000u | (static_cast<uint32_t>(round) << 4) | static_cast<uint32_t>(which), 0x13579BDFu,
                    0x2468ACE0u);
}

// Read rounds follow the write rounds, one per parity.
constexpr int kReadRounds = 2;
__host__ __device__ __forceinline__ int write_round_count(const WorkspaceView& v) { return 2 * rounds_per_parity(v); }

// The parts of one parity's pull area (R1) and their two ends: place 2 * part + which (which 0: first, 1: last).
constexpr int kReadParts = 4;
constexpr int kReadPlaces = 2 * kReadParts;
__host__ __device__ __forceinline__ long long read_part_offset(const WorkspaceView& v, int part) {
  return part == 0 ? 0 : v.pull_input_bytes + static_cast<long long>(part - 1) * v.chunk_slot_bytes;
}
__host__ __device__ __forceinline__ long long read_part_bytes(const WorkspaceView& v, int part) {
  return part == 0 ? v.pull_input_bytes : v.chunk_slot_bytes;
}

// The slab offset of the place that `reader` loads from `owner`'s pull area of `parity` (R2).
__host__ __device__ __forceinline__ long long read_place(const WorkspaceView& v, int parity, int owner, int reader,
                                                         int place) {
  const int j = (reader - owner - 1 + v.world) % v.world;
  const int part = place >> 1;
  const long long start = v.pull_offset + parity * v.pull_region_bytes + read_part_offset(v, part);
  return (place & 1) == 0 ? start + static_cast<long long>(j) * kPackBytes
                          : start + read_part_bytes(v, part) - static_cast<long long>(j + 1) * kPackBytes;
}

// As probe_pattern, with tags of their own, so a load served by a write round's pack is caught as well.
__device__ __forceinline__ uint4 read_pattern(int owner, int reader, int round, int place) {
  return make_uint4(0x71000000u | (static_cast<uint32_t>(owner) << 8) | static_cast<uint32_t>(reader),
                    0x94000000u | (static_cast<uint32_t>(round) << 4) | static_cast<uint32_t>(place), 0xC0FFEE11u,
                    0x0DDBA115u);
}

// What the debug switch does to the loads from `drop_peer`: flips a bit of the first word, as a read path that
// corrupts data would; the result is never the pattern and never the fill (R4), so the pair reports wrong data.
constexpr uint32_t kReadDropFlip = 0x00100000u;

// Thread 2p + which handles place `which` with peer p: it writes ours into p's slab, then waits for p's in ours.
// `drop_peer` (>= 0 only in the tests' debug switch) skips the writes to that peer, which must then show up as a
// failed pair on that peer.
__global__ void probe_kernel(WorkspaceView ws, int round, int drop_peer, long long timeout_ns, int* outcomes) {
  const int peer = static_cast<int>(threadIdx.x) >> 1;
  const int which = static_cast<int>(threadIdx.x) & 1;
  if (peer >= ws.world || peer == ws.rank) return;
  const long long send_at = probe_place(ws, round, ws.rank, which);
  if (send_at >= 0 && peer != drop_peer)
    store_volatile(ws.bases[peer] + send_at, probe_pattern(ws.rank, peer, round, which));
  __threadfence_system();
  const long long receive_at = probe_place(ws, round, peer, which);
  // Scratch starts empty (I1) and flags start at 0 (P3): a place has "landed" once it is no longer that, and is
  // left so again.
  const bool flags = area_of(ws, round) == kAreaFlags;
  int outcome = kProbeOk;
  if (receive_at >= 0) {
    char* mine = ws.bases[ws.rank] + receive_at;
    const uint4 expect = probe_pattern(peer, ws.rank, round, which);
    const long long start = static_cast<long long>(global_timer_ns());
    outcome = kProbeMissing;
    while (static_cast<long long>(global_timer_ns()) - start <= timeout_ns) {
      const uint4 v = load_volatile(mine);
      const bool landed = flags ? (v.x | v.y | v.z | v.w) != 0u : !half_pack_has_empty(v);  // I3 per lane
      if (landed) {
        const bool same = v.x == expect.x && v.y == expect.y && v.z == expect.z && v.w == expect.w;
        outcome = same ? kProbeOk : kProbeWrong;
        break;
      }
    }
    store_volatile(mine, flags ? make_uint4(0u, 0u, 0u, 0u) : empty_pack());  // I4 / P3
    __threadfence_system();
  }
  if (outcome != kProbeOk) atomicMax(&outcomes[peer], outcome);
}

// Thread kReadPlaces * p + place handles one place with peer p: it stages the pack that p loads from us there
// (R2), then loads its own pack from p's area until it shows up or the timeout passes (R3, R4). `drop_peer` (>= 0
// only in the tests' debug switch) corrupts what this rank loads from that peer (kReadDropFlip).
__global__ void probe_read_kernel(WorkspaceView ws, int round, int drop_peer, long long timeout_ns, int* outcomes) {
  const int peer = static_cast<int>(threadIdx.x) / kReadPlaces;
  const int place = static_cast<int>(threadIdx.x) % kReadPlaces;
  if (peer >= ws.world || peer == ws.rank) return;
  const int parity = round - write_round_count(ws);
  store_volatile(ws.bases[ws.rank] + read_place(ws, parity, ws.rank, peer, place),
                 read_pattern(ws.rank, peer, round, place));
  __threadfence_system();
  char* theirs = ws.bases[peer] + read_place(ws, parity, peer, ws.rank, place);
  const uint4 expect = read_pattern(peer, ws.rank, round, place);
  const uint4 fill = empty_pack();
  bool seen = false, other = false;
  unsigned int misses = 0;
  const long long start = static_cast<long long>(global_timer_ns());
  while (static_cast<long long>(global_timer_ns()) - start <= timeout_ns) {
    uint4 v = load_volatile(theirs);
    if (peer == drop_peer) v.x ^= kReadDropFlip;
    if (v.x == expect.x && v.y == expect.y && v.z == expect.z && v.w == expect.w) {
      seen = true;
      break;
    }
    other |= v.x != fill.x || v.y != fill.y || v.z != fill.z || v.w != fill.w;
    __nanosleep(misses >= 3u ? 1024u : 128u << misses);  // R3
    ++misses;
  }
  if (seen) {
    store_volatile(theirs, fill);  // R4: ours alone (R2)
    __threadfence_system();
  }
  const int outcome = seen ? kProbeOk : (other ? kProbeReadWrong : kProbeReadMissing);
  if (outcome != kProbeOk) atomicMax(&outcomes[peer], outcome);
}

}  // namespace

int probe_round_count(const WorkspaceView& view) { return write_round_count(view) + kReadRounds; }

bool probe_round_reads(const WorkspaceView& view, int round) {
  return round >= write_round_count(view) && round < probe_round_count(view);
}

std::string probe_round_name(const WorkspaceView& view, int round) {
  if (probe_round_reads(view, round))
    return "parity " + std::to_string(round - write_round_count(view)) +
           ", peer loads from the pull area (first and last pack of its input copy, partial planes and result)";
  const int per = rounds_per_parity(view);
  const int k = round % per;
  std::string where;
  switch (area_of(view, round)) {
    case kAreaOneShot: where = "the one-shot slots (first and last pack)"; break;
    case kAreaChunks: {
      const long long first = static_cast<long long>(k - 1) * view.world;
      const long long last = std::min<long long>(first + view.world, chunk_blocks(view)) - 1;
      where = "chunk blocks " + std::to_string(first) + "-" + std::to_string(last) + " of " +
              std::to_string(chunk_blocks(view)) + " (first and last pack)";
      break;
    }
    case kAreaRegionEnd: where = "the end of the region"; break;
    case kAreaPull: where = "the pull area (both ends)"; break;
    default: where = "the flags (both ends)"; break;
  }
  return "parity " + std::to_string(round / per) + ", " + where;
}

std::string workspace_probe(Workspace* ws, long long timeout_ns, int round, int drop_peer, int* outcomes) {
  if (round < 0 || round >= probe_round_count(ws->view)) return "probe round out of range";
  const bool reads = probe_round_reads(ws->view, round);
  if (reads) {
    for (int part = 0; part < kReadParts; ++part)
      if (read_part_bytes(ws->view, part) < 2ll * (ws->view.world - 1) * kPackBytes)  // R2
        return "data-path probe: part " + std::to_string(part) + " of the pull area holds " +
               std::to_string(read_part_bytes(ws->view, part)) + " B, too few for a read place per peer";
  }
  cudaError_t err = cudaSetDevice(ws->device);
  int* d_outcomes = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&d_outcomes, kMaxWorld * sizeof(int));
  if (err == cudaSuccess) err = cudaMemset(d_outcomes, 0, kMaxWorld * sizeof(int));
  if (err == cudaSuccess) {
    if (reads) {
      probe_read_kernel<<<1, kReadPlaces * kMaxWorld>>>(ws->view, round, drop_peer, timeout_ns, d_outcomes);
    } else {
      probe_kernel<<<1, 2 * kMaxWorld>>>(ws->view, round, drop_peer, timeout_ns, d_outcomes);
    }
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(outcomes, d_outcomes, kMaxWorld * sizeof(int), cudaMemcpyDeviceToHost);
  if (d_outcomes != nullptr) cudaFree(d_outcomes);
  if (err != cudaSuccess)
    return std::string("data-path probe: ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  for (int p = 0; p < kMaxWorld; ++p)
    if (outcomes[p] == 0) outcomes[p] = kProbeOk;  // no place failed
  return "";
}

}  // namespace sgl_sm120
