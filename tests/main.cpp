// The test runner: doctest's own main, so `chunkwise-tests --help` lists doctest's filters
// (-tc="name*", -ts=suite, -s for successful checks). Every failed check fails the run.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
