// VllmEventSubscriber without libzmq: refuses to start, saying how to get it.
#include "kvshard/common/error.h"
#include "kvshard/router/vllm_event_subscriber.h"

namespace kvshard {

struct VllmEventSubscriber::Impl {};

bool VllmEventSubscriber::available() { return false; }

VllmEventSubscriber::VllmEventSubscriber(KvIndex&, std::vector<VllmEventEndpoint>,
                                         VllmSubscriberOptions) {
    throw Error(
        "this kvshard was built without libzmq, so it cannot subscribe to vLLM's KV events; "
        "install libzmq3-dev and cppzmq-dev (scripts/install-deps.sh) and configure again");
}

VllmEventSubscriber::~VllmEventSubscriber() = default;
void VllmEventSubscriber::stop() {}
void VllmEventSubscriber::with_index(
    const std::function<void(const KvIndex&, const VllmEventIngest&)>&) const {}
VllmFeedStatus VllmEventSubscriber::status(int) const { return {}; }

}  // namespace kvshard
