#pragma once
// RouterHttpServer: the HTTP JSON API of `kvshard router serve` over a RouteService
// (docs/router.md, "The service"):
//   POST /route {"token_ids": [...], "request_id": "..."}
//        -> {"replica", "matched_blocks": {name: n}, "load": {name: blocks}, "reason"}
//   POST /requests/{id}/finished   -> {"finished": true|false}
//   GET  /replicas                 -> RouteService::replicas_json()
//   GET  /metrics                  -> Prometheus text
//   GET  /healthz                  -> ok
// Bad requests get 400 with {"error": "..."}. It binds to loopback unless allow_remote is set;
// bodies are capped (max_body_bytes). The HTTP backend (cpp-httplib) is optional: without it,
// available() is false and the constructor throws Error.
#include <memory>
#include <string>

#include "kvshard/router/route_service.h"

namespace kvshard {

struct RouterHttpOptions {
    std::string host = "127.0.0.1";
    int port = 0;               // 0: any free port (port() says which)
    bool allow_remote = false;  // binding to a non-loopback address needs this
    size_t max_body_bytes = 8 << 20;
    size_t keep_alive_max_requests = 100000;  // requests per connection before it is closed
    // Threads that serve connections. cpp-httplib holds a thread for a keep-alive connection
    // until the client closes it or it stays idle for keep_alive_timeout_s, so this is also the
    // number of clients served at once: one more waits for a thread.
    int threads = 64;
    int keep_alive_timeout_s = 5;  // an idle keep-alive connection is closed after this
};

// Error unless host is a loopback address (127.x.x.x, ::1, localhost) or allow_remote is set,
// the port is 0 to 65535, threads is 1 to 4096 and keep_alive_timeout_s is 1 to 3600.
void check_http_options(const RouterHttpOptions& o);

class RouterHttpServer {
  public:
    static bool available();
    // Binds; Error when the address is refused or cannot be bound.
    RouterHttpServer(RouteService& service, RouterHttpOptions options);
    ~RouterHttpServer();
    RouterHttpServer(const RouterHttpServer&) = delete;
    RouterHttpServer& operator=(const RouterHttpServer&) = delete;

    int port() const;
    // Serves until stop() (from another thread); returns then. A stop() that comes before run()
    // (or before it has begun listening) is not lost: run() returns at once.
    void run();
    void stop();

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvshard
