"""An environment for the fault tests (tests/faults/test_env_faults.py), served in a subprocess by
`python -m tailrace.protocol.env_sdk slow_env:SlowEnv` run from this folder: a step sleeps the seconds its
action names ("sleep 30"), so a test can kill or freeze the server while it holds a request."""

import time


class SlowEnv:
    def reset(self, prompt, metadata):
        return "ready"

    def step(self, action):
        if action.startswith("sleep "):
            time.sleep(float(action.split()[1]))
        return {"text": f"did {action}", "done": action == "stop", "reward": 1.0 if action == "stop" else None}
