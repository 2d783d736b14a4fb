from hawk.cli import main

main()
