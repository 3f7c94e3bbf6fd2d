import os

from distrun.protocol.environment import STORE_ROLE_VAR

if os.environ.get(STORE_ROLE_VAR) == "1":
    from distrun.runtime._agent import serve_agent

    serve_agent()
else:
    from distrun.runtime._main import main

    main()
