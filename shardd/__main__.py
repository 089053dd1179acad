from shardd.cli import main

main()
