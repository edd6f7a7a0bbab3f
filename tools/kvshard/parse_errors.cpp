#include "parse_errors.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdint>
#include <regex>
#include <sstream>
#include <string_view>

namespace kvshard::cli {
namespace {

std::string commands(const CLI::App& app) {
    std::string out;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
        out += (out.empty() ? "" : ", ") + sub->get_name();
    return out;
}

// "an integer", "a number" or "text" for an option's CLI11 type name.
std::string expected_of(const CLI::Option* opt) {
    const std::string t = opt ? opt->get_type_name() : "";
    if (t.rfind("INT", 0) == 0 || t.rfind("UINT", 0) == 0) return "an integer";
    if (t.rfind("FLOAT", 0) == 0) return "a number";
    return "a value";
}

const CLI::Option* find_option(const CLI::App* sub, const std::string& name) {
    if (!sub) return nullptr;
    try {
        return sub->get_option(name);
    } catch (const CLI::OptionNotFound&) {
        return nullptr;
    }
}

// The text of a signed (or, for UINT options, unsigned) 64-bit decimal integer, or what is wrong.
// What CLI11's integer conversion (strtoll / strtoull, base 0) would wrongly accept in text:
// empty text (read as 0), a value past 64 bits (clamped), a 0x / 0b prefix or a leading 0
// (hex, binary, octal). A decimal with leading zeros is rewritten without them; text that is
// not a number at all is left to CLI11, whose error describe_parse_error words.
std::string decimal_integer_error(std::string& text, bool is_unsigned) {
    if (text.empty()) return "expects an integer, got ''";
    const size_t sign = text[0] == '-' ? 1 : 0;
    if (is_unsigned && sign) return {};  // strtoull negates it: the option's range check refuses
    const size_t digits_end = text.find_first_not_of("0123456789", sign);
    if (digits_end == sign) return {};  // not a number: CLI11's error
    if (digits_end != std::string::npos) {
        // 0x10, 0b1, 010e: a prefix or suffix CLI11 might read as a number.
        if (text[sign] == '0' && digits_end == sign + 1 &&
            (text[digits_end] == 'x' || text[digits_end] == 'X' || text[digits_end] == 'b' ||
             text[digits_end] == 'B'))
            return fmt::format("expects a decimal integer (digits, e.g. 16), got '{}'", text);
        return {};
    }
    const char* first = text.data();
    const char* last = text.data() + text.size();
    std::from_chars_result r{};
    std::string canonical;  // without leading zeros, which CLI11 would read as octal
    if (is_unsigned) {
        uint64_t v = 0;
        r = std::from_chars(first, last, v);
        canonical = std::to_string(v);
    } else {
        int64_t v = 0;
        r = std::from_chars(first, last, v);
        canonical = std::to_string(v);
    }
    // Unsigned (--seed): strtoull clamps to 2^64 - 1, which the option's range check refuses.
    if (r.ec == std::errc::result_out_of_range && is_unsigned) return {};
    if (r.ec == std::errc::result_out_of_range)
        return fmt::format(
            "'{}' does not fit in a 64-bit integer; give a value in [-9223372036854775808, "
            "9223372036854775807]",
            text);
    text = canonical;
    return {};
}

}  // namespace

void require_decimal_integers(CLI::App& app) {
    for (CLI::Option* opt : app.get_options()) {
        const std::string t = opt->get_type_name();
        const bool is_unsigned = t.rfind("UINT", 0) == 0;
        if (!is_unsigned && t.rfind("INT", 0) != 0) continue;
        opt->transform(CLI::Validator(
            [is_unsigned](std::string& text) { return decimal_integer_error(text, is_unsigned); },
            ""));
    }
    for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
        require_decimal_integers(*sub);
}

const CLI::App* named_subcommand(const CLI::App& app, int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
        const std::string_view a = argv[i];
        if (a.empty() || a[0] == '-') continue;
        for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
            if (sub->get_name() == a) return sub;
        return nullptr;  // the first word is not a command
    }
    return nullptr;
}

std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e, int argc,
                                 char** argv) {
    const CLI::App* sub = named_subcommand(app, argc, argv);
    const std::string what = e.what();
    const std::string help =
        sub ? fmt::format("see 'kvshard {} --help'", sub->get_name()) : "see 'kvshard --help'";
    std::smatch m;
    if (!sub) {
        for (int i = 1; i < argc; ++i)
            if (argv[i][0] != '-')
                return fmt::format("unknown command '{}': expected one of {}", argv[i],
                                   commands(app));
        if (what == "A subcommand is required")
            return fmt::format("no command given: expected one of {} ({})", commands(app), help);
    }
    static const std::regex kConvert("Could not convert: (\\S+) = (.*)");
    if (std::regex_match(what, m, kConvert)) {
        const CLI::Option* opt = find_option(sub, m[1]);
        const bool digits = std::regex_match(m[2].str(), std::regex("-?[0-9]+"));
        return fmt::format("{} expects {}, got '{}' ({}{})", m[1].str(), expected_of(opt),
                           m[2].str(), digits ? "out of range for the option; " : "", help);
    }
    static const std::regex kRange("(\\S+): Value (\\S+) not in range (\\S+) to (\\S+)");
    if (std::regex_search(what, m, kRange)) {
        if (!std::regex_match(m[2].str(), std::regex("-?[0-9.eE+]+")))
            return fmt::format("{} expects an integer in [{}, {}], got '{}' ({})", m[1].str(),
                               m[3].str(), m[4].str(), m[2].str(), help);
        return fmt::format("{} must be in [{}, {}], got {} ({})", m[1].str(), m[3].str(),
                           m[4].str(), m[2].str(), help);
    }
    static const std::regex kMissing("(\\S+): \\d+ required ([A-Z]+).* missing");
    if (std::regex_match(what, m, kMissing))
        return fmt::format("{} needs a value ({}; {})", m[1].str(), m[2].str(), help);
    static const std::regex kExtras("The following arguments? (were|was) not expected: (.*)");
    if (std::regex_match(what, m, kExtras)) {
        // CLI11 lists them in reverse; name the first option-like word, or the first word.
        std::string words = m[2].str(), unknown;
        std::istringstream in(words);
        for (std::string w; in >> w;)
            if (unknown.empty() || (w.rfind("-", 0) == 0 && unknown.rfind("-", 0) != 0))
                unknown = w;
        if (unknown.rfind("-", 0) == 0)
            return fmt::format("unknown option '{}' for kvshard {} ({})", unknown,
                               sub ? sub->get_name() : "", help);
        return fmt::format("unexpected argument '{}' for kvshard {}: it takes options only ({})",
                           unknown, sub ? sub->get_name() : "", help);
    }
    static const std::regex kRequired("(\\S+) is required");
    if (std::regex_match(what, m, kRequired))
        return fmt::format("{} is required ({})", m[1].str(), help);
    return fmt::format("{} ({})", what, help);
}

}  // namespace kvshard::cli
