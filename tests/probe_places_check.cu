// Host-only check of the probe's read places (csrc/probe.cu R1, R2), built and run by tests/test_probe_places.py:
// the places' geometry decides whether a read round can pass on a healthy fabric (two readers on one place would
// empty each other's pack) and whether it covers the edges pull loads from, and none of it needs a GPU. Also that
// the write rounds reach both ends of the flag area.
// One translation unit with the sources, so their internal helpers (scratch_sizes, read_place) are in reach.
#include <cstdio>
#include <set>
#include <utility>

#include "../csrc/probe.cu"
#include "../csrc/workspace.cu"

namespace sgl_sm120 {
// workspace.cu's creation path calls it (it lives with the kernels); never reached here.
cudaError_t query_cluster_capacity(int, int, int, int*) { return cudaErrorNotSupported; }
}  // namespace sgl_sm120

namespace {

int failures = 0;

void fail(const char* what, int world, long long max_numel, int parity, int owner, int reader, int place) {
  if (++failures <= 20)
    std::printf("FAIL %s: world %d max_numel %lld parity %d owner %d reader %d place %d\n", what, world, max_numel,
                parity, owner, reader, place);
}

// The view as workspace_create lays it out for these sizes.
sgl_sm120::WorkspaceView view_for(int world, long long max_numel, const sgl_sm120::Topology& islands) {
  using namespace sgl_sm120;
  Topology flat{};
  flat.island_size = world;
  flat.num_islands = 1;
  const ScratchSizes z = scratch_sizes(world, max_numel, max_numel, flat, islands);
  WorkspaceView v{};
  v.world = world;
  v.region_bytes = z.region;
  v.oneshot_slot_bytes = z.oneshot_slot;
  v.chunk_slot_bytes = z.chunk_slot;
  v.pull_offset = kRegionsOffset + 2 * z.region;
  v.pull_region_bytes = z.pull_region;
  v.pull_input_bytes = z.pull_input;
  v.flat = flat;
  v.islands = islands;
  return v;
}

void check(int world, long long max_numel, const sgl_sm120::Topology& islands) {
  using namespace sgl_sm120;
  WorkspaceView v = view_for(world, max_numel, islands);
  // The read rounds are the last two, one per parity, after every write round.
  const int rounds = probe_round_count(v);
  for (int r = 0; r < rounds; ++r)
    if (probe_round_reads(v, r) != (r >= rounds - kReadRounds)) fail("round kind", world, max_numel, -1, -1, -1, r);
  if (probe_round_reads(v, rounds)) fail("round past the end reads", world, max_numel, -1, -1, -1, rounds);
  // The flag rounds write the first and last pack of the flag area, which holds the flags of both call parities.
  bool flags_first = false, flags_last = false;
  for (int r = 0; r < write_round_count(v); ++r) {
    if (area_of(v, r) != kAreaFlags) continue;
    for (int sender = 0; sender < world; ++sender) {
      flags_first |= probe_place(v, r, sender, 0) == kCtrlBytes;
      flags_last |= probe_place(v, r, sender, 1) == kCtrlBytes + kFlagBytes - kPackBytes;
    }
  }
  if (!flags_first || !flags_last)
    fail("an end of the flag area no write round reaches", world, max_numel, -1, -1, -1, -1);
  // pull.cuh's parts of one parity's area, as its consumers address them (R1): input copy, plane 0, 1, result.
  const long long part_start[4] = {0, v.pull_input_bytes, v.pull_input_bytes + v.chunk_slot_bytes,
                                   v.pull_input_bytes + 2 * v.chunk_slot_bytes};
  const long long part_end[4] = {v.pull_input_bytes, v.pull_input_bytes + v.chunk_slot_bytes,
                                 v.pull_input_bytes + 2 * v.chunk_slot_bytes, v.pull_region_bytes};
  if (part_end[3] != v.pull_input_bytes + 3 * v.chunk_slot_bytes)
    fail("pull area size", world, max_numel, -1, -1, -1, -1);
  for (int parity = 0; parity < 2; ++parity) {
    const long long area = v.pull_offset + parity * v.pull_region_bytes;
    for (int owner = 0; owner < world; ++owner) {
      std::set<long long> used;
      std::set<std::pair<int, int>> edges;  // (part, end) reached by some reader
      for (int reader = 0; reader < world; ++reader) {
        if (reader == owner) continue;
        for (int place = 0; place < kReadPlaces; ++place) {
          const long long at = read_place(v, parity, owner, reader, place);
          const int part = place >> 1;
          if (at % kPackBytes != 0) fail("misaligned", world, max_numel, parity, owner, reader, place);
          if (at < area + part_start[part] || at + kPackBytes > area + part_end[part])
            fail("outside its part", world, max_numel, parity, owner, reader, place);
          if (!used.insert(at).second)
            fail("shared by two readers or places", world, max_numel, parity, owner, reader, place);
          if ((place & 1) == 0 && at == area + part_start[part]) edges.insert({part, 0});
          if ((place & 1) == 1 && at + kPackBytes == area + part_end[part]) edges.insert({part, 1});
        }
      }
      if (edges.size() != 2 * 4)
        fail("an edge of the pull area nobody loads", world, max_numel, parity, owner, -1, -1);
    }
  }
}

}  // namespace

int main() {
  using namespace sgl_sm120;
  const long long sizes[] = {8, 64, 3 * 7168, 64 * 7168, 1 << 20, (1 << 20) + 8};
  for (int world : {2, 4, 8}) {
    for (long long n : sizes) {
      Topology none{};
      check(world, n, none);
      if (world == 8) {
        Topology two{};  // two islands of four, as at 8 ranks over two switches
        two.island_size = 4;
        two.num_islands = 2;
        check(world, n, two);
      }
    }
  }
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
