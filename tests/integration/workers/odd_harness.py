"""A harness that misbehaves as its task says: hang, crash, write garbage, or sleep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

task = json.loads(os.environ["HARNESSRL_TASK"])
behaviour = task["behaviour"]
if behaviour == "hang":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)
elif behaviour == "crash":
    os.kill(os.getpid(), signal.SIGKILL)
elif behaviour == "garbage":
    print('HARNESSRL_RESULT {"answer": ')
elif behaviour == "sleep":
    time.sleep(float(task.get("seconds", 2)))
    print('HARNESSRL_RESULT {"slept": true}')
