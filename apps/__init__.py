"""The applications built on the services (`harnessrl.apps.<name>`): the command line (cli),
the local stack (up), experiments, the doctor, the chaos run and the coding-task pipeline
(swe). They import services and the library; nothing below them imports them."""
