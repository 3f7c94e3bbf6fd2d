import os

from distrun.protocol.environment import STORE_ROLE_VAR
from distrun.runtime._netns_join import join_private_network

join_private_network()  # a local job's own network, before anything can start a thread

if os.environ.get(STORE_ROLE_VAR) == "1":
    from distrun.runtime._agent import serve_agent

    serve_agent()
else:
    from distrun.runtime._main import main

    main()
