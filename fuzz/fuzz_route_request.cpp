// libFuzzer: the body of POST /route, as a gateway sends it (parse_route_request). Two checks:
// kvshard::Error is the only answer to bad input, and the one-pass reader of the usual body agrees
// with a full JSON parser on every input: the same token ids, request id, LoRA name and cache salt,
// or both refuse. The reference below is the documented rule (route_service.h) written with
// nlohmann::json alone.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "kvshard/common/error.h"
#include "kvshard/router/route_service.h"

namespace {

std::optional<kvshard::RouteRequestBody> reference(std::string_view body) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(body);
    } catch (const std::exception&) {
        return std::nullopt;
    }
    if (!j.is_object() || !j.contains("token_ids") || !j["token_ids"].is_array())
        return std::nullopt;
    kvshard::RouteRequestBody out;
    for (const auto& t : j["token_ids"]) {
        if (!t.is_number_integer()) return std::nullopt;
        if (t.is_number_unsigned() ? t.get<uint64_t>() > INT32_MAX
                                   : (t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX))
            return std::nullopt;
        out.token_ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    if (j.contains("request_id")) {
        if (!j["request_id"].is_string()) return std::nullopt;
        out.request_id = j["request_id"].get<std::string>();
    }
    for (const char* key : {"lora_name", "cache_salt"}) {
        if (!j.contains(key) || j[key].is_null()) continue;
        if (!j[key].is_string() || j[key].get<std::string>().empty()) return std::nullopt;
        (std::string_view(key) == "lora_name" ? out.extra.lora_name : out.extra.cache_salt) =
            j[key].get<std::string>();
    }
    return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view body(reinterpret_cast<const char*>(data), size);
    std::optional<kvshard::RouteRequestBody> got;
    try {
        got = kvshard::parse_route_request(body);
    } catch (const kvshard::Error&) {
    }
    const auto want = reference(body);
    if (got.has_value() != want.has_value()) __builtin_trap();
    if (got && (got->token_ids != want->token_ids || got->request_id != want->request_id ||
                got->extra.lora_name != want->extra.lora_name ||
                got->extra.cache_salt != want->extra.cache_salt))
        __builtin_trap();
    return 0;
}
