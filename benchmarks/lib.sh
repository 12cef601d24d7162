# Sourced by the benchmark scripts (run from the repository root).
# config_value CONFIG EXPR: EXPR evaluated on the resolved config `c`, e.g. config_value "$CFG" c.run_dir
config_value() { .venv/bin/python -c "from pipeline.config import load_config; c = load_config('$1'); print($2)"; }
