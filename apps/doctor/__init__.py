"""harnessrl doctor: will this harness train well? (see doctor.run)"""
