#pragma once
// Internal: a flat byte buffer for exchanging small reports between ranks (all-gather of blobs).
// Trivially copyable values are written as their bytes; vectors and strings carry an int64 count.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvshard/common/error.h"

namespace kvshard {

class ByteWriter {
  public:
    template <typename T>
    void put(const T& v) {
        // resize + memcpy: GCC 12 warns (-Wstringop-overflow) on a range insert into an empty
        // vector
        const size_t at = buf_.size();
        buf_.resize(at + sizeof(T));
        std::memcpy(buf_.data() + at, &v, sizeof(T));
    }
    template <typename T>
    void put_vec(const std::vector<T>& v) {
        put<int64_t>(static_cast<int64_t>(v.size()));
        const auto* p = reinterpret_cast<const std::byte*>(v.data());
        buf_.insert(buf_.end(), p, p + v.size() * sizeof(T));
    }
    void put_str(const std::string& s) { put_vec(std::vector<char>(s.begin(), s.end())); }
    const std::vector<std::byte>& bytes() const { return buf_; }

  private:
    std::vector<std::byte> buf_;
};

class ByteReader {
  public:
    explicit ByteReader(const std::vector<std::byte>& b) : b_(b) {}
    template <typename T>
    T get() {
        KVSHARD_CHECK(pos_ + sizeof(T) <= b_.size(), "report buffer underrun");
        T v;
        std::memcpy(&v, b_.data() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    template <typename T>
    std::vector<T> get_vec() {
        const auto n = static_cast<size_t>(get<int64_t>());
        KVSHARD_CHECK(pos_ + n * sizeof(T) <= b_.size(), "report buffer underrun");
        std::vector<T> v(n);
        if (n) std::memcpy(v.data(), b_.data() + pos_, n * sizeof(T));
        pos_ += n * sizeof(T);
        return v;
    }
    std::string get_str() {
        const auto v = get_vec<char>();
        return {v.begin(), v.end()};
    }

  private:
    const std::vector<std::byte>& b_;
    size_t pos_ = 0;
};

}  // namespace kvshard
