// Shareable memory: another process (here: a forked child, and this process itself) maps the
// owner's arena read-only and sees its bytes; a wrong id is refused with a reason; the memory is
// sealed; a view outlives its arena.
#include "kvshard/common/shared_arena.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace kvshard {
namespace {

void fill(SharedArena& a) {
    for (size_t i = 0; i < a.size(); ++i) a.data()[i] = static_cast<std::byte>(i * 7 + 3);
}

bool holds_pattern(const std::byte* p, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (p[i] != static_cast<std::byte>(i * 7 + 3)) return false;
    return true;
}

TEST(SharedArena, SupportedHere) { EXPECT_TRUE(SharedArena::supported()); }

TEST(SharedArena, SizeRoundedToPagesAndZeroFilled) {
    SharedArena a(10000);
    EXPECT_EQ(a.size(), 12288u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.data()[i], std::byte{0});
    EXPECT_EQ(a.id().pid, getpid());
    EXPECT_GE(a.id().fd, 0);
    EXPECT_NE(a.id().token[0] | a.id().token[1], 0u);
}

TEST(SharedArena, ViewInThisProcessSeesTheOwnersWrites) {
    SharedArena a(1 << 20);
    fill(a);
    std::string why;
    auto v = SharedArenaView::open(a.id(), &why);
    ASSERT_TRUE(v) << why;
    EXPECT_EQ(v->size(), a.size());
    EXPECT_NE(v->data(), a.data());  // a second mapping of the same memory
    EXPECT_TRUE(holds_pattern(v->data(), v->size()));
    a.data()[12345] = std::byte{0x42};  // later writes show through
    EXPECT_EQ(v->data()[12345], std::byte{0x42});
}

TEST(SharedArena, AnotherProcessReadsIt) {
    SharedArena a(3 << 20);
    fill(a);
    const SharedArenaId id = a.id();
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        // The child maps the parent's arena through /proc/<parent>/fd/<fd>, as a destination
        // rank in another process does.
        auto v = SharedArenaView::open(id);
        const int code = !v                                     ? 1
                         : v->size() != id.bytes                ? 2
                         : !holds_pattern(v->data(), v->size()) ? 3
                                                                : 0;
        _exit(code);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "1: not mapped, 2: wrong size, 3: wrong bytes";
}

TEST(SharedArena, WrongIdsAreRefusedWithAReason) {
    SharedArena a(8192);
    std::string why;
    SharedArenaId id = a.id();
    id.token[1] ^= 1;
    EXPECT_FALSE(SharedArenaView::open(id, &why));
    EXPECT_NE(why.find("token"), std::string::npos) << why;

    id = a.id();
    id.bytes += 4096;
    EXPECT_FALSE(SharedArenaView::open(id, &why));
    EXPECT_NE(why.find("not an arena"), std::string::npos) << why;

    id = a.id();
    id.fd = 1 << 20;  // no such descriptor
    EXPECT_FALSE(SharedArenaView::open(id, &why));
    EXPECT_NE(why.find("cannot open"), std::string::npos) << why;

    EXPECT_FALSE(SharedArenaView::open(SharedArenaId{}, &why));
    EXPECT_NE(why.find("no shareable arena"), std::string::npos) << why;
}

TEST(SharedArena, SealedAgainstResizing) {
    SharedArena a(8192);
    EXPECT_NE(ftruncate(a.id().fd, 0), 0);  // a reader's mapping can never lose its pages
    EXPECT_NE(ftruncate(a.id().fd, 1 << 20), 0);
}

TEST(SharedArena, ViewOutlivesTheArena) {
    std::unique_ptr<SharedArenaView> v;
    {
        SharedArena a(64 << 10);
        fill(a);
        v = SharedArenaView::open(a.id());
        ASSERT_TRUE(v);
    }
    EXPECT_TRUE(holds_pattern(v->data(), v->size()));
}

TEST(SharedArenaViews, KeepsViewsAndEvictsTheLeastRecentlyUsed) {
    SharedArena a(4096), b(4096), c(4096);
    SharedArenaViews views(2);
    auto va = views.get(a.id());
    ASSERT_TRUE(va);
    EXPECT_EQ(views.get(a.id()), va);  // the same mapping again
    auto vb = views.get(b.id());
    EXPECT_EQ(views.get(a.id()), va);  // a is now the most recent
    auto vc = views.get(c.id());       // evicts b
    EXPECT_EQ(views.get(a.id()), va);
    EXPECT_NE(views.get(b.id()), vb);  // b was reopened: another mapping
    SharedArenaId bad = c.id();
    bad.token[0] ^= 1;
    std::string why;
    EXPECT_FALSE(views.get(bad, &why));
    EXPECT_FALSE(why.empty());
}

}  // namespace
}  // namespace kvshard
