#pragma once
// How RouterHttpServer sets up its cpp-httplib server, shared with bench_router_service's no-op
// ceiling so that the ceiling is served exactly as the router is (the same thread pool, backlog,
// keep-alive and socket options). Needs cpp-httplib (router_http.cpp's backend).
#include <httplib.h>

#include "kvshard/router/http_server.h"

namespace kvshard {

// Applies `o` to `server`: one pool thread per connection being served (o.threads), keep-alive
// timeout and request count, the body cap, TCP_NODELAY, and SO_REUSEADDR alone (the library's
// default SO_REUSEPORT lets a second server bind the same port). The listening socket is written
// to *listen_fd when the server binds; listen_fd must outlive the server's binding.
void configure_http_server(httplib::Server& server, const RouterHttpOptions& o, int* listen_fd);

// Binds `server` (configured above) to o.host:o.port (port 0: any free port) and widens its accept
// queue to kHttpListenBacklog; returns the port. Error when the address cannot be bound.
int bind_http_server(httplib::Server& server, const RouterHttpOptions& o, const int* listen_fd);

// The accept queue of the listening socket (the kernel caps it at net.core.somaxconn). Debian's
// cpp-httplib is a compiled library that listens with a backlog of 5: gateways that connect at once
// overflow it, and each dropped SYN waits for the kernel's 1 s retry.
inline constexpr int kHttpListenBacklog = 4096;

}  // namespace kvshard
