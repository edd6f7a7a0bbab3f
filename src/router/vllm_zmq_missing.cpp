// VllmEventSubscriber and VllmEventPublisher without libzmq: they refuse to start, saying how to
// get it.
#include "kvshard/common/error.h"
#include "kvshard/router/vllm_event_publisher.h"
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

struct VllmEventPublisher::Impl {};
bool VllmEventPublisher::available() { return false; }
VllmEventPublisher::VllmEventPublisher(VllmPublisherOptions) {
    throw Error(
        "this kvshard was built without libzmq, so it cannot publish KV events; install "
        "libzmq3-dev and cppzmq-dev (scripts/install-deps.sh) and configure again");
}
VllmEventPublisher::~VllmEventPublisher() = default;
std::string VllmEventPublisher::endpoint() const { return {}; }
std::string VllmEventPublisher::replay_endpoint() const { return {}; }
bool VllmEventPublisher::wait_for_subscriber(std::chrono::milliseconds) { return false; }
uint64_t VllmEventPublisher::publish(VllmEventBatch) { return 0; }
KvEventCallback VllmEventPublisher::block_manager_callback() { return {}; }

}  // namespace kvshard
