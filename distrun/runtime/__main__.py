from distrun.runtime._main import main

main()
