// A benchmark binary whose cases are memtrack regions: one capture, figures per case.
//
//   c++ -O2 -g -I"$(python3 -m memtrack.control)" examples/regions/bench.cc -o bench
//   sudo memtrack capture -o bench.memtrack -- ./bench
//   memtrack process bench.memtrack -o bench.duckdb
//   memtrack report bench.duckdb                     # the REGIONS section: one line a case
//   memtrack report bench.duckdb --region map_insert  # one case, with its allocation sites
//
// Each case runs inside a Region: every allocation its thread makes in it is the case's
// (a case that starts threads would mark regions in them too). Outside memtrack the
// calls do nothing and the cases run as they would. Only the header is needed: no
// library to link, no dependency.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "memtrack_control.h"

namespace {

class Region {  // RAII: the enclosing scope is the region `name`
public:
    explicit Region(const char *name) : on_(memtrack_region_begin(name) == 0) {}
    ~Region() {
        if (on_)
            memtrack_region_end();
    }
    Region(const Region &) = delete;
    Region &operator=(const Region &) = delete;

private:
    bool on_;
};

volatile std::size_t sink;

void vector_push() {
    std::vector<long> v;
    for (long i = 0; i < 100000; i++)
        v.push_back(i);
    sink = v.size();
}

void map_insert() {
    std::map<int, std::string> m;
    for (int i = 0; i < 2000; i++)
        m[i] = std::string(40, 'x');
    sink = m.size();
}

void string_concat() {
    std::string s;
    for (int i = 0; i < 5000; i++)
        s += "memtrack";
    sink = s.size();
}

std::vector<int *> cache;

void leak_100() {  // keeps 100 blocks of 25 ints: alive at the case's end
    for (int i = 0; i < 100; i++)
        cache.push_back(new int[25]());
}

struct Case {
    const char *name;
    void (*run)();
};
const Case cases[] = {{"vector_push", vector_push}, {"map_insert", map_insert},
                      {"string_concat", string_concat}, {"leak_100", leak_100}};

}  // namespace

int main() {
    cache.reserve(100);  // the harness's own allocation, outside every case
    for (const Case &c : cases) {
        auto t0 = std::chrono::steady_clock::now();
        {
            Region region(c.name);
            c.run();
        }
        std::chrono::duration<double, std::micro> us = std::chrono::steady_clock::now() - t0;
        std::printf("%-14s %9.1f us\n", c.name, us.count());
    }
    return 0;
}
