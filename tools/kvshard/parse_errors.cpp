#include "parse_errors.h"

#include <fmt/format.h>

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

}  // namespace

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
