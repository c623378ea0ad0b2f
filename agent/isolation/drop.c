/*
 * trainyard-drop [--devpts DIR] UID COMMAND [ARG...]: become user and group UID with no supplementary groups, no
 * capability (none kept, none to gain: empty bounding, inheritable and ambient sets) and no_new_privs, then run
 * COMMAND. With --devpts, first mount a new instance of devpts at DIR, as bwrap's --dev does: the sandbox's /dev is
 * then a read-only view its holder made once, shared by every sandbox of the node (agent/processes/holder.py,
 * SandboxMounts), and its terminals are its own.
 *
 * The first process of a job's sandbox runs it where the agent is root (agent/isolation/sandbox.py, `dropper`):
 * it does what `setpriv --reuid=UID --regid=UID --clear-groups --inh-caps=-all --bounding-set=-all
 * --no-new-privs` does, without setpriv's start-up (its locale, a user lookup through NSS and the libraries
 * that loads), about 1 ms of CPU a job. Built static by `make install` (with musl where it is: glibc's start-up
 * probes the CPU's caches, 0.3 ms more a start on a virtual machine), so that it also runs inside any image.
 * Exit codes: 125 when it cannot drop (nothing of the job ran), 126 or 127 when COMMAND cannot be run or is
 * not found, as a shell says.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CANNOT_DROP 125

/* capset(2)'s arguments, as <linux/capability.h> has them (which not every C library ships): version 3, two words. */
#define CAPABILITY_VERSION_3 0x20080522
struct cap_header { unsigned int version; int pid; };
struct cap_data { unsigned int effective, permitted, inheritable; };

static void fail(const char *step) {
    fprintf(stderr, "trainyard-drop: %s failed: %s\n", step, strerror(errno));
    exit(CANNOT_DROP);
}

static uid_t parse_uid(const char *text) {
    char *end = NULL;
    errno = 0;
    unsigned long value = strtoul(text, &end, 10);
    /* Never root (a job allowed root runs without this program), never -1 (the "unchanged" id). */
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-' || value == 0 || value >= (uid_t)-1) {
        fprintf(stderr, "trainyard-drop: %s is not a user id (a number above 0)\n", text);
        exit(CANNOT_DROP);
    }
    return (uid_t)value;
}

int main(int argc, char **argv) {
    const char *devpts = NULL;
    if (argc > 2 && strcmp(argv[1], "--devpts") == 0) {
        devpts = argv[2];
        argc -= 2;
        argv += 2;
    }
    if (argc < 3) {
        fputs("usage: trainyard-drop [--devpts DIR] UID COMMAND [ARG...]\n", stderr);
        return CANNOT_DROP;
    }
    uid_t id = parse_uid(argv[1]);
    /* While still root: the options bwrap's --dev gives its own devpts (ptys any user may open, each its owner's). */
    if (devpts != NULL && mount("devpts", devpts, "devpts", MS_NOSUID | MS_NOEXEC,
                                "newinstance,ptmxmode=0666,mode=620") != 0)
        fail("mounting a devpts of the sandbox's own");
    /* The bounding set first, while the process still has CAP_SETPCAP; past the last capability: EINVAL. */
    for (int cap = 0; cap < 64; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL)
            fail("dropping the capability bounding set");
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
        fail("clearing the ambient capabilities");
    if (setgroups(0, NULL) != 0)
        fail("clearing the supplementary groups");
    if (setresgid(id, id, id) != 0)
        fail("changing the group");
    if (setresuid(id, id, id) != 0)
        fail("changing the user");
    /* Leaving root clears the permitted and effective sets, not the inheritable one: clear all three. */
    struct cap_header header = {CAPABILITY_VERSION_3, 0};
    struct cap_data data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) != 0)
        fail("clearing the capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail("setting no_new_privs");
    /* What could go back to root must not: a user that can regain uid 0 would still be root. */
    if (setresuid(0, 0, 0) == 0 || getuid() != id || geteuid() != id || getgid() != id || getegid() != id) {
        fputs("trainyard-drop: the user could not be dropped for good\n", stderr);
        return CANNOT_DROP;
    }
    execvp(argv[2], argv + 2);
    int error = errno;
    fprintf(stderr, "trainyard-drop: cannot run %s: %s\n", argv[2], strerror(error));
    return error == ENOENT ? 127 : 126;
}
