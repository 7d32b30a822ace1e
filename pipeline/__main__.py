from quantpipe.cli import main

main()
