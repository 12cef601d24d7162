"""Method tests: griffin/ on tiny random models, single process, seconds (`make test-fast`)."""
