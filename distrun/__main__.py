from distrun._entry import main

main()
