// Host-only check of I6's rule (csrc/ar_protocol.cuh; stream_step in csrc/ar_launch.h), built and run by
// tests/test_stream_order.py: the sequences of streams SGLang, the tuner and the tests make pass without a refusal
// and with an order exactly where a call changes stream; eager calls from two streams are ordered after each other;
// captured calls from two streams of one capture get an edge; the one unorderable call is refused. Streams are
// stand-in handles and a capture is what the stand-in says, so none of it needs a GPU.
#include <cstdio>
#include <map>
#include <string>

#include "../csrc/ar_launch.h"

namespace {

using sgl_sm120::StreamOrder;
using sgl_sm120::StreamStep;

int failures = 0;

cudaStream_t stream(long long id) { return reinterpret_cast<cudaStream_t>(id); }
const cudaStream_t kDefault = nullptr, kCapture = stream(0x10), kCapture2 = stream(0x18), kForward = stream(0x20),
                   kSide = stream(0x30), kLane = stream(0x40), kLane2 = stream(0x48);

// One workspace's calls, the captures in progress as the stand-in for CUDA says, and what each call did.
struct Calls {
  std::string name;
  StreamOrder order;
  std::map<cudaStream_t, unsigned long long> capturing;  // stream -> capture id
  int slow = 0;                                           // calls that asked CUDA anything

  StreamStep call(cudaStream_t s) {
    bool asked = false;
    const StreamStep step = sgl_sm120::stream_step(order, s, [&](cudaStream_t q) {
      asked = true;
      const auto found = capturing.find(q);
      return found == capturing.end() ? 0ull : found->second;
    });
    slow += asked;
    if (step.kind == StreamStep::kGo || step.kind == StreamStep::kOrderAfter) order = step.next;
    return step;
  }

  void expect(cudaStream_t s, StreamStep::Kind kind, cudaStream_t after = nullptr, const char* what = "") {
    const StreamStep step = call(s);
    const bool ok = step.kind == kind && (kind == StreamStep::kGo || step.after == after);
    if (!ok && ++failures <= 20)
      std::printf("FAIL %s, %s: step %d after %p, expected %d after %p\n", name.c_str(), what, step.kind,
                  static_cast<void*>(step.after), kind, static_cast<void*>(after));
  }
};

void check(bool ok, const std::string& what) {
  if (!ok && ++failures <= 20) std::printf("FAIL %s\n", what.c_str());
}

// SGLang: the workspace is built before capture; each runner's capture warms up eagerly on its capture stream (the
// device synchronized first), captures there, and the server then serves eager calls and replays (not calls) on its
// forward stream. No call is refused; the changes of stream are ordered; serving is the fast path.
void sglang_start_and_serve() {
  Calls c{"SGLang"};
  c.expect(kCapture, StreamStep::kGo, nullptr, "the first call, a warm-up on the capture stream");
  c.expect(kCapture, StreamStep::kGo, nullptr, "the second warm-up");
  c.capturing[kCapture] = 1;
  for (int i = 0; i < 3; ++i) c.expect(kCapture, StreamStep::kGo, nullptr, "a captured call on the capture stream");
  c.capturing.erase(kCapture);
  c.expect(kCapture, StreamStep::kGo, nullptr, "the next size's warm-up");
  c.capturing[kCapture] = 2;
  c.expect(kCapture, StreamStep::kGo, nullptr, "its capture");
  c.capturing.erase(kCapture);
  c.expect(kCapture2, StreamStep::kOrderAfter, kCapture, "the draft's warm-up on its own capture stream");
  c.capturing[kCapture2] = 3;
  c.expect(kCapture2, StreamStep::kGo, nullptr, "the draft's capture");
  c.capturing.erase(kCapture2);
  c.expect(kForward, StreamStep::kOrderAfter, kCapture2, "the first eager call of serving");
  const int slow = c.slow;
  for (int i = 0; i < 100; ++i) c.expect(kForward, StreamStep::kGo, nullptr, "serving");
  check(c.slow == slow, "serving from one stream asks CUDA nothing (the fast path is one comparison)");
}

// Eager calls from two streams, no order from the caller: each is ordered after the other stream's.
void two_eager_streams() {
  Calls c{"two eager streams"};
  c.expect(kForward, StreamStep::kGo);
  for (int i = 0; i < 3; ++i) {
    c.expect(kSide, StreamStep::kOrderAfter, kForward, "to the second stream");
    c.expect(kForward, StreamStep::kOrderAfter, kSide, "back to the first");
  }
}

// A graph captured on a side stream while the eager calls stay on the default stream (the tests' device counter):
// nothing to order, and the eager calls after it take no order (their stream did not change).
void capture_on_a_side_stream() {
  Calls c{"a side-stream capture"};
  c.expect(kDefault, StreamStep::kGo);
  c.capturing[kSide] = 7;
  c.expect(kSide, StreamStep::kGo, nullptr, "a captured call from the side stream");
  c.expect(kSide, StreamStep::kGo, nullptr, "another");
  c.capturing.erase(kSide);
  c.expect(kDefault, StreamStep::kGo, nullptr, "an eager call on the default stream after the capture");
  c.expect(kDefault, StreamStep::kGo, nullptr, "and the next");
}

// One capture whose calls alternate between its stream and a stream forked from it: an edge for every change.
void one_capture_on_two_streams() {
  Calls c{"one capture on two streams"};
  c.expect(kCapture, StreamStep::kGo, nullptr, "the eager warm-up");
  c.capturing[kCapture] = c.capturing[kSide] = 5;
  c.expect(kCapture, StreamStep::kGo, nullptr, "the first captured call, from the eager stream");
  c.expect(kSide, StreamStep::kOrderAfter, kCapture, "the forked stream");
  c.expect(kCapture, StreamStep::kOrderAfter, kSide, "back to the capture stream");
  c.expect(kCapture, StreamStep::kGo, nullptr, "again from it");
  c.expect(kSide, StreamStep::kOrderAfter, kCapture, "the forked stream again");
  c.capturing.clear();
  c.expect(kCapture, StreamStep::kGo, nullptr, "an eager call from the eager stream after the capture");
}

// The one call that cannot be ordered: eager, while the previous eager call's stream captures. Refused, and the
// record is unchanged, so the calls after the capture are ordered as ever.
void eager_call_while_the_eager_stream_captures() {
  Calls c{"an eager call during a capture"};
  c.expect(kCapture, StreamStep::kGo);
  c.capturing[kCapture] = 9;
  c.expect(kCapture, StreamStep::kGo, nullptr, "a captured call");
  c.expect(kSide, StreamStep::kRefuse, kCapture, "an eager call from another stream during the capture");
  c.capturing.clear();
  c.expect(kSide, StreamStep::kOrderAfter, kCapture, "the same call after the capture");
  c.expect(kCapture, StreamStep::kOrderAfter, kSide, "and back");
}

// The tuner: each candidate's eager calls and capture on lane streams, a new lane stream for a later candidate.
void tuner_lanes() {
  Calls c{"tuner lanes"};
  c.expect(kLane, StreamStep::kGo, nullptr, "a candidate's eager call");
  c.capturing[kCapture] = c.capturing[kLane] = 11;
  c.expect(kLane, StreamStep::kGo, nullptr, "its captured calls on the lane forked from the capture stream");
  c.capturing.clear();
  c.expect(kLane2, StreamStep::kOrderAfter, kLane, "the next candidate's lane");
}

// CUDA that cannot say is not a guess.
void unknown_capture_state() {
  Calls c{"unknown"};
  c.expect(kForward, StreamStep::kGo);
  c.capturing[kSide] = sgl_sm120::kCaptureUnknown;
  c.expect(kSide, StreamStep::kUnknown, kSide, "a stream CUDA cannot answer for");
  c.capturing.clear();
  c.capturing[kForward] = sgl_sm120::kCaptureUnknown;
  c.expect(kSide, StreamStep::kUnknown, kForward, "the previous eager stream CUDA cannot answer for");
}

}  // namespace

int main() {
  sglang_start_and_serve();
  two_eager_streams();
  capture_on_a_side_stream();
  one_capture_on_two_streams();
  eager_call_while_the_eager_stream_captures();
  tuner_lanes();
  unknown_capture_state();
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
