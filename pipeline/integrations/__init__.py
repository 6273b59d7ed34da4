"""lengthwise inside other systems' schedulers (Airflow), always through the `lengthwise` command.

A scheduler's worker runs `lengthwise` as a child process, never in its own interpreter: it needs
neither torch nor the model in its environment, a crash or an out-of-memory kill of the job
cannot take the worker down, and the exit codes (`pipeline.core.exit_codes`) are the one
contract it branches on. `commands` builds those command lines and reads their answers (no
scheduler imported); `airflow` holds the operators, sensor and trigger.
"""
