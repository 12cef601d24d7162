"""Pipeline tests: the stages on the tiny target, with a local Ray where a stage needs one."""
