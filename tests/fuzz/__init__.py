"""The seeded random fuzzer over samoyeds' public API (issue 44): tests/fuzz/fuzz.py."""
