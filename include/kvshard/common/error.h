#pragma once
// Two kinds of failure (GUIDE.md, convention 6):
//  - kvshard::Error: wrong user input (a bad flag, an impossible layout, a malformed file). The
//  message
//    says what is wrong and what would be right. The CLI prints "kvshard: error: <what>" and
//    exits 2.
//  - kvshard::InternalError: a broken internal invariant, raised by KVSHARD_CHECK, naming the
//  invariant.
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvshard {

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string& what) : std::runtime_error(what) {}
};

class InternalError : public std::logic_error {
  public:
    explicit InternalError(const std::string& what) : std::logic_error(what) {}
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
    std::ostringstream os;
    (os << ... << std::forward<Args>(args));
    return os.str();
}
[[noreturn]] void throw_internal(const char* file, int line, const char* cond,
                                 const std::string& msg);
}  // namespace detail

// Throws kvshard::Error with the pieces streamed together when `cond` is false.
template <typename... Args>
void require(bool cond, Args&&... message_pieces) {
    if (!cond) throw Error(detail::concat(std::forward<Args>(message_pieces)...));
}

}  // namespace kvshard

// Internal invariant check: always on (cheap, control path only). Never use it for user input.
#define KVSHARD_CHECK(cond, ...)                                           \
    do {                                                                   \
        if (!(cond))                                                       \
            ::kvshard::detail::throw_internal(                             \
                __FILE__, __LINE__, #cond,                                 \
                ::kvshard::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
    } while (0)
