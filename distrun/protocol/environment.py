"""Environment variables by which a launcher talks to the training processes it starts.

Both sides (``distrun.launch`` and ``distrun.runtime``) import these names from
here, so the contract is written once.
"""

EVENT_FD_VAR = "DISTRUN_EVENT_FD"  # write end of the event pipe (NDJSON events)
STORE_FD_VAR = "DISTRUN_STORE_FD"  # rank 0 only: listening socket for the TCPStore
PARENT_PID_VAR = "DISTRUN_PARENT_PID"  # the launcher; training processes die with it
JOB_SPEC_VAR = "DISTRUN_JOB_SPEC"  # JobSpec as JSON
EVAL_CHECKPOINT_VAR = "DISTRUN_EVAL_CHECKPOINT"  # evaluator role: evaluate this checkpoint, then exit
STORE_ROLE_VAR = "DISTRUN_ELASTIC_AGENT"  # --elastic: this process is a launcher's agent (hosts the store on STORE_FD)
AGENT_FD_VAR = "DISTRUN_AGENT_FD"  # --elastic: the agent reads "lost RANK INCARNATION" lines on this fd
INCARNATION_VAR = "DISTRUN_INCARNATION"  # --elastic: how many times this rank was started before (0 first)
ELASTIC_JOINER_VAR = "DISTRUN_ELASTIC_JOINER"  # --elastic: this rank was started again, and joins a running job
CACHE_DIR_VAR = "DISTRUN_CACHE_DIR"  # a worker server's per-host cache folder (compiled kernels)
JOB_SECRET_VAR = "DISTRUN_JOB_SECRET"  # the job's 256-bit secret (hex): the data plane's key (docs/security.md)
CHIEF_ADDR_VAR = "DISTRUN_CHIEF_ADDR"  # the chief host's cluster address (MASTER_ADDR is the loopback store relay)
DEBUG_DIR_VAR = "DISTRUN_DEBUG_DIR"  # where a rank writes its Flight Recorder dump (the job's debug folder)
DIAGNOSE_FD_VAR = "DISTRUN_DIAGNOSE_FD"  # read end of a pipe: each byte asks for a Flight Recorder dump
SUPERVISOR_PID_VAR = "DISTRUN_SUPERVISOR_PID"  # the launcher: it (and its py-spy) may ptrace the rank (Yama)
NETNS_FDS_VAR = "DISTRUN_NETNS_FDS"  # a local job's private network: "NET_FD,USER_FD" to join first (launch/_netns)
#: torchrun's per-rank error file (torch's ``@record`` writes a failure there). distrun's launcher names
#: rank R's ``error-rankR.json`` in the job's debug folder, and removes what is left when the job ends.
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
ERROR_FILE_PREFIX = "error-rank"

#: torch's Flight Recorder: how many collectives each rank keeps (torch's default is 0: off).
#: distrun turns it on for every job unless the user's environment sets it (0 turns it off).
FLIGHT_RECORDER_VAR = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = 2000

#: A rank's exit code after it wrote a checkpoint and stopped because it was told the job would
#: end (SIGUSR1: Slurm's warning before a time limit or a preemption). BSD's EX_TEMPFAIL: try again.
PREEMPTED_EXIT_CODE = 75

#: ``--elastic``: a rank's exit code when it found itself cut off from the job (its connection to
#: the store broke, as a partition longer than TCP's patience leaves it). Not a failure: its
#: launcher marks it lost and starts it again as a joiner, healed by a peer (issue 52).
CUT_OFF_EXIT_CODE = 76
