"""The supervisor's exit codes, in one place for the CLI, the arbiter and the operator
commands. systemd restarts 1 and 4 and never 2, 3 or 5, which would only repeat (see
conf/queue-supervisor@.service, RestartPreventExitStatus=2 3 5, and docs/operations.md)."""

OK = 0
#: The job: the broker is unreachable. An operator command: work is left (drain, check).
BROKER = LEFT = 1
#: A bad configuration, or a wrong command line.
CONFIG = USAGE = 2
#: The handler could not be loaded or its init() failed (in every process it would).
HANDLER_INIT = 3
#: Something broke inside (the fork server died, a loop raised): start afresh.
BROKEN = 4
#: The broker refused this client: credentials, permissions, a database it lacks, a NATS
#: server too old for the queue (broker.nats.version).
REFUSED = 5
