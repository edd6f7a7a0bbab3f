// RouterHttpServer without cpp-httplib: refuses to start, saying how to get it.
#include "kvshard/common/error.h"
#include "kvshard/router/http_server.h"

namespace kvshard {

struct RouterHttpServer::Impl {};
bool RouterHttpServer::available() { return false; }
RouterHttpServer::RouterHttpServer(RouteService&, RouterHttpOptions) {
    throw Error(
        "this kvshard was built without cpp-httplib, so it cannot serve HTTP; install "
        "libcpp-httplib-dev (scripts/install-deps.sh) and configure again");
}
RouterHttpServer::~RouterHttpServer() = default;
int RouterHttpServer::port() const { return 0; }
void RouterHttpServer::run() {}
void RouterHttpServer::stop() {}

}  // namespace kvshard
