// The cpp-httplib backend of RouterHttpServer (built when httplib.h is found; else
// router_http_missing.cpp).
#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvshard/common/error.h"
#include "kvshard/router/http_server.h"
#include "router/http_setup.h"

namespace kvshard {
namespace {

// The JSON replies' media type. With its charset parameter (JSON is UTF-8, RFC 8259) cpp-httplib
// does not compress the reply for a client that accepts br or gzip (it compresses the bare
// "application/json"): a route reply is a few dozen bytes, and brotli cost about 0.7 ms of it.
// tests/router/router_serve_test.cpp checks that a reply to such a client is plain.
constexpr const char* kJson = "application/json; charset=utf-8";

void reply_error(httplib::Response& res, RouteService& svc, const std::string& what) {
    svc.count_bad_request();
    res.status = 400;
    res.set_content(nlohmann::json{{"error", what}}.dump(), kJson);
}

}  // namespace

void configure_http_server(httplib::Server& server, const RouterHttpOptions& o, int* listen_fd) {
    // One pool thread per connection being served (see RouterHttpOptions::threads); the
    // library's default is max(8, cores - 1), which a ninth keep-alive client would wait on.
    server.new_task_queue = [n = static_cast<size_t>(o.threads)] {
        return new httplib::ThreadPool(n);
    };
    server.set_keep_alive_timeout(o.keep_alive_timeout_s);
    server.set_payload_max_length(o.max_body_bytes);
    server.set_tcp_nodelay(true);  // small JSON replies: no Nagle delay
    // The library's default options set SO_REUSEPORT, with which a second router on the same
    // port binds too and takes half the connections; SO_REUSEADDR alone refuses it. The
    // socket is kept to widen its backlog once it listens.
    server.set_socket_options([listen_fd](socket_t sock) {
        int yes = 1;
        ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        *listen_fd = sock;
    });
    // cpp-httplib closes a keep-alive connection after 5 requests by default: a router's
    // client (a gateway) keeps one open for many, and a reconnect costs more than a route.
    server.set_keep_alive_max_count(o.keep_alive_max_requests);
}

int bind_http_server(httplib::Server& server, const RouterHttpOptions& o, const int* listen_fd) {
    const int port = o.port == 0 ? server.bind_to_any_port(o.host)
                                 : (server.bind_to_port(o.host, o.port) ? o.port : -1);
    require(port > 0, "cannot listen on ", o.host, ":", o.port,
            " (in use, or not an address of this machine)");
    // listen() on a listening socket sets its backlog anew (Linux, POSIX leaves it open).
    require(::listen(*listen_fd, kHttpListenBacklog) == 0, "cannot widen the accept queue of ",
            o.host, ":", port);
    return port;
}

struct RouterHttpServer::Impl {
    RouteService* svc;
    RouterHttpOptions options;
    httplib::Server server;
    int port = 0;
    int listen_fd = -1;
    // cpp-httplib's stop() does nothing until listen has begun (is_running()), so a stop() that
    // comes first would be lost and run() would serve on; these let stop() wait for it, or keep
    // run() from starting.
    std::mutex run_mutex;
    bool run_called = false;
    bool stop_requested = false;
    std::atomic<bool> run_returned{false};

    Impl(RouteService& s, RouterHttpOptions o) : svc(&s), options(std::move(o)) {
        check_http_options(options);
        configure_http_server(server, options, &listen_fd);
        server.Post("/route", [this](const httplib::Request& req, httplib::Response& res) {
            route(req, res);
        });
        server.Post(R"(/requests/([^/]+)/finished)",
                    [this](const httplib::Request& req, httplib::Response& res) {
                        const bool found = svc->finished(req.matches[1]);
                        res.set_content(nlohmann::json{{"finished", found}}.dump(), kJson);
                    });
        server.Get("/replicas", [this](const httplib::Request&, httplib::Response& res) {
            res.set_content(svc->replicas_json(), kJson);
        });
        server.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
            res.set_content(svc->metrics_text(), "text/plain; version=0.0.4");
        });
        server.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
            res.set_content("ok\n", "text/plain");
        });
        port = bind_http_server(server, options, &listen_fd);
    }

    void route(const httplib::Request& req, httplib::Response& res) {
        try {
            const RouteRequestBody body = parse_route_request(req.body);
            const RouteOutcome o = svc->route(body.request_id, body.token_ids, body.extra);
            res.set_content(svc->route_reply_json(o), kJson);
        } catch (const Error& e) {
            reply_error(res, *svc, e.what());
        }
    }
};

bool RouterHttpServer::available() { return true; }

RouterHttpServer::RouterHttpServer(RouteService& service, RouterHttpOptions options)
    : impl_(std::make_unique<Impl>(service, std::move(options))) {}

RouterHttpServer::~RouterHttpServer() { stop(); }

int RouterHttpServer::port() const { return impl_->port; }

void RouterHttpServer::run() {
    {
        std::lock_guard<std::mutex> lock(impl_->run_mutex);
        if (impl_->stop_requested) return;
        impl_->run_called = true;
    }
    impl_->server.listen_after_bind();
    impl_->run_returned = true;
}

void RouterHttpServer::stop() {
    if (!impl_) return;
    {
        std::lock_guard<std::mutex> lock(impl_->run_mutex);
        impl_->stop_requested = true;
        if (!impl_->run_called) return;  // run() will not start serving
    }
    while (!impl_->server.is_running() && !impl_->run_returned)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    impl_->server.stop();
}

}  // namespace kvshard
