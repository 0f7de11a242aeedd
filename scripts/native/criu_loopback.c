/*
 * belayer-criu-loopback: the CRIU action script listed in /etc/criu/runc.conf
 * (belayer_env/host/loopback.py), as a static program. Two jobs, one exec per stage.
 *
 * CRIU execs every action script at every stage of every dump and restore that runc drives:
 * seven times per restore, four per dump (three inside the freeze). As a shell script it
 * cost ~2 ms per stage here (a shell start) and ~6 ms at setup-namespaces (nsenter, then
 * ip): ~17 ms of CRIU's ~60 ms restore.
 *
 * 1. Loopback (restores): at setup-namespaces it enters the restored init's network
 *    namespace and sets lo up (what `ip link set lo up` does; the kernel gives lo its
 *    addresses when it comes up).
 * 2. Relay (Belayer's own dumps, whose environment names the relay: BELAYER_RELAY_*, set
 *    by belayer_env/criu/hooks.py): tell the checkpointer which stage CRIU is at through a
 *    FIFO and, at pre-dump and post-dump, wait for its answer on another. The answer FIFO
 *    is read with the checkpointer as its only writer, so a checkpointer that dies leaves
 *    the read at EOF: the stage fails (CRIU resumes the tasks), and where the checkpointer
 *    had frozen the cgroup the watcher it names (a python one-liner) thaws it once CRIU
 *    has exited. The shell script hooks.py writes where this build is missing does the same.
 *
 * At every other stage, or without the relay's environment, it exits at once.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* belayer_env/host/loopback.py recognises an installed build by this string; 2: relays too */
const char belayer_mark[] = "belayer-criu-loopback static 2";

static int fail(const char *what)
{
    fprintf(stderr, "belayer-criu-loopback: %s: %m\n", what);
    return 1;
}

static int loopback_up(const char *pid)
{
    char path[64];

    if (strspn(pid, "0123456789") != strlen(pid) || strlen(pid) > 10)
        return fail("CRTOOLS_INIT_PID is not a pid");
    snprintf(path, sizeof(path), "/proc/%s/ns/net", pid);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0)
        return fail(path);
    if (setns(ns, CLONE_NEWNET) < 0)
        return fail("setns");
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return fail("socket");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        return fail("SIOCGIFFLAGS lo");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        return fail("SIOCSIFFLAGS lo");
    return 0;
}

static const char *need(const char *name)
{
    const char *value = getenv(name);
    if (!value || !*value) {
        fprintf(stderr, "belayer-criu-loopback: %s is not set\n", name);
        exit(1);
    }
    return value;
}

/* The checkpointer ("PID START", START its start time in clock ticks) is still that process,
 * and not a zombie. */
static int owner_alive(const char *owner)
{
    char path[64], stat[1024], start[32];
    unsigned long pid;

    if (sscanf(owner, "%lu %31s", &pid, start) != 2)
        return 0;
    snprintf(path, sizeof(path), "/proc/%lu/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, stat, sizeof(stat) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    stat[n] = '\0';
    char *p = strrchr(stat, ')'); /* the command name may hold spaces and parentheses */
    if (!p)
        return 0;
    /* after ") ": state is field 3; the start time is field 22 */
    if (p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'))
        return 0;
    for (int field = 2; field < 22 && p; field++)
        p = strchr(p + 1, ' ');
    if (!p)
        return 0;
    size_t len = strcspn(p + 1, " ");
    return len == strlen(start) && strncmp(p + 1, start, len) == 0;
}

/* The checkpointer is gone: start the watcher that thaws the cgroup once CRIU has exited.
 * exiting: its answer FIFO's last writer closed, so it is exiting (a process's files close
 * before it turns zombie): wait for that, up to the dump's bound. */
static void orphaned(int exiting)
{
    const char *owner = need("BELAYER_RELAY_OWNER");
    if (exiting) {
        const char *bound = getenv("BELAYER_RELAY_BOUND");
        long polls = (bound ? atol(bound) : 60) * 1000;
        struct timespec ms = {0, 1000000};
        for (long i = 0; i < polls && owner_alive(owner); i++)
            nanosleep(&ms, NULL);
    }
    if (owner_alive(owner))
        return;
    const char *python = getenv("BELAYER_RELAY_PYTHON"), *watch = getenv("BELAYER_RELAY_WATCH");
    const char *file = getenv("BELAYER_RELAY_THAW_FILE"), *value = getenv("BELAYER_RELAY_THAW_VALUE");
    const char *bound = getenv("BELAYER_RELAY_BOUND");
    if (!python || !watch || !file || !*file || !value || !bound)
        return; /* nothing was frozen for CRIU */
    char self[24];
    snprintf(self, sizeof(self), "%d", (int)getpid());
    pid_t child = fork();
    if (child == 0) {
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
        }
        execl(python, python, "-I", "-S", "-c", watch, self, file, value, bound, (char *)NULL);
        _exit(127);
    }
    if (child > 0)
        waitpid(child, NULL, 0); /* the watcher forks and returns at once */
}

static void say(const char *event)
{
    int fd = open(need("BELAYER_RELAY_EVENTS"), O_RDWR | O_CLOEXEC);
    char line[32];
    int n = snprintf(line, sizeof(line), "%s\n", event);
    if (fd < 0 || write(fd, line, (size_t)n) != n)
        exit(fail("the relay's events FIFO"));
    close(fd);
}

/* Wait for "ok" or "fail"; 0 for ok. */
static int answer(const char *event)
{
    const char *fifo = need("BELAYER_RELAY_ANSWER");
    int own = open(fifo, O_RDWR | O_CLOEXEC);          /* never blocks */
    int fd = own < 0 ? -1 : open(fifo, O_RDONLY | O_CLOEXEC); /* a writer exists: no block */
    if (own >= 0)
        close(own); /* the checkpointer is now the only writer */
    if (fd < 0)
        return fail("the relay's answer FIFO");
    say(event);
    char reply[16];
    size_t got = 0;
    while (got < sizeof(reply) - 1) {
        ssize_t n = read(fd, reply + got, 1);
        if (n <= 0)
            break; /* EOF: the checkpointer is gone */
        if (reply[got] == '\n') {
            reply[got] = '\0';
            return strcmp(reply, "ok") == 0 ? 0 : 1;
        }
        got += (size_t)n;
    }
    orphaned(1);
    return 1; /* CRIU fails the dump and resumes the tasks */
}

static int relay(const char *action)
{
    if (strcmp(action, "pre-dump") == 0)
        return answer("freeze");
    if (strcmp(action, "post-dump") == 0)
        return answer("dumped");
    if (strcmp(action, "network-lock") == 0)
        say("frozen");
    else if (strcmp(action, "network-unlock") == 0) {
        say("resuming");
        orphaned(0);
    }
    return 0;
}

int main(void)
{
    const char *action = getenv("CRTOOLS_SCRIPT_ACTION");

    if (!action)
        return 0;
    if (strcmp(action, "setup-namespaces") == 0) {
        const char *pid = getenv("CRTOOLS_INIT_PID");
        return pid && *pid ? loopback_up(pid) : 0;
    }
    if (getenv("BELAYER_RELAY_EVENTS"))
        return relay(action);
    return 0;
}
