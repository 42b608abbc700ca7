"""The words the prompt sets are built from: templates per category with {slots}, and the
slot values. The held-out set's templates and topics are disjoint from the training set's, so
held-out accept lengths measure prompts of a kind never trained on.

Changing anything here changes the prompts `make_prompts.py` writes.
"""

# fmt: off
# ---- training vocabulary ------------------------------------------------------------------------
TOPICS = [
    "photosynthesis", "black holes", "DNA", "volcanoes", "earthquakes", "the water cycle",
    "plate tectonics", "the immune system", "vaccines", "antibiotics", "gravity",
    "electricity", "magnetism", "nuclear fusion", "solar panels", "wind turbines",
    "electric cars", "batteries", "the internet", "Wi-Fi", "GPS", "smartphones",
    "machine learning", "neural networks", "cloud computing", "blockchain", "cryptography",
    "search engines", "social media", "email", "3D printing", "robots", "self-driving cars",
    "the Roman Empire", "ancient Egypt", "the printing press", "the Industrial Revolution",
    "the French Revolution", "the Renaissance", "the Cold War", "the Moon landing",
    "the Olympic Games", "democracy", "inflation", "interest rates", "the stock market",
    "supply and demand", "taxes", "credit cards", "compound interest", "budgeting",
    "bees", "rainforests", "deserts", "the ocean tides", "coral", "dinosaurs", "evolution",
    "climate change", "recycling", "composting", "clouds", "rainbows", "thunderstorms",
    "the seasons", "the solar system", "Mars", "the Sun", "comets", "the Milky Way",
    "sleep", "exercise", "meditation", "healthy eating", "hydration", "caffeine", "stress",
    "the human heart", "the brain", "memory", "habits", "motivation", "time management",
    "public speaking", "negotiation", "leadership", "teamwork", "job interviews",
    "writing a resume", "learning to code", "chess", "jazz", "classical music",
    "impressionist painting", "photography", "film editing", "poetry", "novels",
    "the history of football", "basketball", "yoga", "gardening", "baking bread",
    "coffee brewing", "tea", "chocolate", "cheese making", "fermentation", "vitamins",
    "the metric system", "calendars", "time zones", "maps", "languages", "grammar",
    "libraries", "museums", "airplanes", "trains", "bicycles", "bridges", "skyscrapers",
    "elections", "the United Nations", "human rights", "copyright", "open source software",
    "operating systems", "databases", "spreadsheets", "password security", "phishing",
    "computer viruses", "backups", "video games", "virtual reality", "podcasts",
    "renewable energy", "fossil fuels", "water purification", "agriculture", "fishing",
    "urban planning", "public transport", "minimalism", "volunteering", "pets",
    "dogs", "cats", "birds migrating", "whales", "octopuses", "ants", "mushrooms",
    "trees", "the Amazon river", "mountains", "glaciers", "the Sahara", "islands",
]

ACTIVITIES = [
    "learning a new language", "running a first marathon", "studying for exams",
    "cooking rice", "saving money", "starting a vegetable garden", "writing a novel",
    "learning the guitar", "working from home", "moving to a new city", "traveling on a budget",
    "keeping a houseplant alive", "training a puppy", "staying focused", "reading more books",
    "making new friends", "preparing for a job interview", "giving a presentation",
    "taking better photos", "learning to swim", "camping for the first time",
    "organizing a closet", "planning a wedding", "starting a small business",
    "learning to draw", "improving handwriting", "cooking for a large group",
    "hiking in the mountains", "learning Python", "writing a cover letter",
    "teaching kids math", "baking cookies", "painting a room", "buying a used car",
    "choosing a laptop", "studying abroad", "cleaning a kitchen", "meal prepping",
    "staying safe online", "recording a podcast",
]

GOALS = [
    "reduce stress", "sleep better", "save energy at home", "improve my writing",
    "be more productive", "eat more vegetables", "drink more water", "stay motivated",
    "learn faster", "remember names", "spend less time on my phone", "get fit at home",
    "make my mornings easier", "reduce food waste", "be a better listener",
    "keep my desk tidy", "stop procrastinating", "write clearer emails",
    "make better decisions", "feel less lonely", "cut down on sugar", "be more creative",
    "prepare for retirement", "learn new vocabulary", "speak more confidently",
]

THINGS = [
    "famous scientists", "European capitals", "programming languages", "fruits rich in vitamin C",
    "board games for families", "classic novels", "musical instruments", "inventions of the 20th century",
    "planets in the solar system", "healthy breakfast ideas", "indoor plants", "dog breeds",
    "ways to reuse glass jars", "hobbies you can do at home", "famous paintings",
    "renewable energy sources", "countries in South America", "vegetables that grow fast",
    "useful keyboard shortcuts", "kinds of clouds", "types of triangles", "chemical elements",
    "sports played with a ball", "ancient wonders of the world", "kitchen tools",
    "benefits of walking", "common logical fallacies", "famous composers", "rivers in Africa",
    "cheap date ideas",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "finds the largest element in a list", "counts the vowels in a string",
    "merges two sorted lists", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "reads a CSV file and prints the number of rows",
    "returns the first n Fibonacci numbers", "checks if a string is a palindrome",
    "sorts a list of dictionaries by a given key", "flattens a nested list",
    "finds the greatest common divisor of two numbers", "implements binary search",
    "counts how often each word appears in a text", "capitalizes every word in a sentence",
    "computes the sum of the digits of a number", "checks whether two strings are anagrams",
    "finds the second smallest number in a list", "generates a random password",
    "converts a decimal number to binary", "rotates a list by k positions",
    "finds all even numbers in a list", "computes the average of a list of numbers",
    "checks if a year is a leap year", "transposes a matrix", "finds the longest word in a sentence",
    "counts the lines in a text file", "implements a simple stack class",
    "returns the intersection of two lists", "computes the power set of a list",
    "validates that brackets in a string are balanced", "converts a string to title case",
    "prints a multiplication table", "finds the mode of a list", "implements bubble sort",
    "reverses the words in a sentence", "calculates compound interest",
    "removes all whitespace from a string",
]

LANGS = ["Python", "Python", "Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "TypeScript"]

CODE_CONCEPTS = [
    "recursion", "a hash table", "a linked list", "object-oriented programming", "an API",
    "a closure", "Big O notation", "a race condition", "version control", "unit testing",
    "a for loop", "a class and an object", "an exception", "a pointer", "a binary tree",
    "dynamic programming", "a REST API", "a compiler", "garbage collection", "a database index",
    "a lambda function", "inheritance", "a queue", "an interface", "asynchronous programming",
]

SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "for i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 "
    "else 'Buzz' if i % 5 == 0 else i)",
    "def g(n):\n    if n < 2:\n        return n\n    return g(n - 1) + g(n - 2)",
    "counts = {}\nfor w in text.split():\n    counts[w] = counts.get(w, 0) + 1",
    "with open('data.txt') as f:\n    lines = [line.strip() for line in f if line.strip()]",
    "const total = items.reduce((sum, item) => sum + item.price, 0);",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY COUNT(*) DESC LIMIT 5;",
    "def avg(xs):\n    return sum(xs) / len(xs)",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "def add_item(item, items=[]):\n    items.append(item)\n    return items",
    "while n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    steps += 1",
    "squares = dict((i, i ** 2) for i in range(10))",
    "int max(int a, int b) { return a > b ? a : b; }",
    "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))",
    "names = sorted(people, key=lambda p: (p.age, p.name))",
]

MATH_CONCEPTS = [
    "the Pythagorean theorem", "derivatives", "integrals", "probability", "fractions",
    "percentages", "prime numbers", "logarithms", "the mean, median and mode",
    "standard deviation", "negative numbers", "exponents", "the number pi", "matrices",
    "linear equations", "ratios", "the order of operations", "vectors", "infinity",
    "the Fibonacci sequence",
]

NAMES = ["Anna", "Ben", "Carlos", "Dana", "Eli", "Fatima", "George", "Hana", "Ivan", "Julia",
         "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tom"]
ITEMS = ["apple", "marble", "book", "sticker", "pencil", "cookie", "card", "coin", "shell", "stamp"]

PARAGRAPHS = [
    "Honeybees communicate the location of food through a behavior called the waggle dance. "
    "A forager returning to the hive moves in a figure-eight pattern, and the angle of the "
    "central run tells other bees the direction of the flowers relative to the sun. The "
    "length of the run signals the distance.",
    "The printing press, developed by Johannes Gutenberg around 1440, made it possible to "
    "produce books quickly and cheaply. Before it, books were copied by hand, which made them "
    "rare and expensive. Within decades, printed material spread across Europe and helped "
    "fuel the Renaissance and the Reformation.",
    "Remote work has grown rapidly in recent years. Many employees enjoy the flexibility and "
    "the time saved by not commuting. However, some find it harder to separate work from home "
    "life, and companies worry about collaboration and company culture.",
    "Sleep plays a critical role in memory. During deep sleep, the brain replays and "
    "strengthens the connections formed during the day. People who are deprived of sleep "
    "perform worse on tests of learning and attention, even if they do not feel tired.",
    "Coral reefs cover less than one percent of the ocean floor but support about a quarter of "
    "all marine species. Rising ocean temperatures cause corals to expel the algae living in "
    "their tissues, a process called bleaching. Without the algae, corals often starve.",
    "The city council voted on Tuesday to expand the bike lane network by forty kilometers over "
    "the next three years. Supporters say it will reduce traffic and pollution, while some "
    "shop owners fear losing parking spaces in front of their stores.",
    "Inflation measures how quickly prices rise over time. When inflation is high, the same "
    "amount of money buys fewer goods. Central banks often raise interest rates to slow "
    "inflation, which makes borrowing more expensive and cools spending.",
    "The Great Wall of China is not a single wall but a series of fortifications built over "
    "many centuries. Different dynasties added sections to protect against invasions from the "
    "north. Much of what tourists visit today was built during the Ming dynasty.",
    "Regular exercise benefits both the body and the mind. It strengthens the heart, improves "
    "sleep and lowers the risk of many diseases. Studies also show that even short walks can "
    "improve mood and reduce anxiety.",
    "Our team finished the quarter with sales eight percent above target. The new product line "
    "performed especially well in the northern region, while online sales were flat. Next "
    "quarter we will focus on improving the website and training new staff.",
    "Octopuses are remarkably intelligent animals. They can open jars, escape from tanks and "
    "recognize individual humans. Most of their neurons are located in their arms, which can "
    "react to touch and taste without input from the brain.",
    "A vaccine trains the immune system to recognize a germ without causing the disease. It "
    "contains a harmless piece or weakened form of the germ. If the person is later exposed, "
    "their immune system can respond quickly and prevent serious illness.",
    "The library will close for renovations from June 1 to August 15. During this time, "
    "borrowed books can be returned at the community center. Online services, including "
    "e-books and audiobooks, will remain available as usual.",
    "Compound interest means earning interest on both the original amount and on interest "
    "already earned. Over long periods this leads to exponential growth. That is why starting "
    "to save early can make a large difference by retirement.",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. Most are "
    "found along the edges of tectonic plates. Eruptions can be destructive, but volcanic soil "
    "is also very fertile, which is why many people farm nearby.",
    "The new smartphone has a larger screen, a faster processor and a camera that performs "
    "better in low light. Its battery lasts about a day and a half with normal use. Critics "
    "note, however, that the price is higher than last year's model.",
    "Reading to young children every day helps them develop language skills. They learn new "
    "words, hear how sentences are built and begin to understand stories. It also builds a "
    "habit that can make them enjoy reading later in life.",
    "Electric cars produce no exhaust emissions while driving. Their overall environmental "
    "impact depends on how the electricity is generated and how the batteries are made. As "
    "power grids use more renewable energy, electric cars become cleaner.",
    "The Amazon rainforest produces a large share of the world's oxygen and stores huge "
    "amounts of carbon. Deforestation for farming and logging threatens this balance. "
    "Scientists warn that losing too much forest could turn parts of it into savanna.",
    "Customer complaints about late deliveries doubled last month. Most delays came from a "
    "single warehouse that was short on staff. Management has hired temporary workers and "
    "expects delivery times to return to normal within two weeks.",
    "Chess originated in India around the sixth century and spread through Persia to Europe. "
    "The rules changed over time; the queen, for example, became the most powerful piece only "
    "in the fifteenth century. Today, computers play chess better than any human.",
    "Drinking enough water helps regulate body temperature, keeps joints lubricated and "
    "supports digestion. Needs vary with climate and activity. Thirst is usually a reliable "
    "guide for healthy adults.",
]

SENTENCES = [
    "me and him goes to the store yesterday", "the meeting have been moved to friday",
    "i dont know where is the keys", "she don't like coffee in the morning",
    "We was going to call you but we forgot.", "The results of the test was surprising.",
    "Their going to the park later today.", "He runned very fast to catch the bus.",
    "can you send me the file asap", "the weather is bad so the game is cancel",
    "I think that maybe we should possibly consider changing the plan.",
    "The dog chased the ball across the yard.", "Our company sells shoes online.",
    "The project is late because of many problems.", "I need help with my homework.",
    "The food at the restaurant was really good.", "Please tell me when you are free.",
    "The new policy starts next month.", "This phone is too expensive for me.",
    "The children played outside until it got dark.", "We should save more money.",
    "The train was delayed by two hours.", "I am very tired after work.",
    "The movie was long but interesting.", "The report needs more details.",
    "You did a great job on the presentation.", "It is raining and I forgot my umbrella.",
    "The store closes at nine in the evening.", "He forgot his password again.",
    "Learning to cook is easier than you think.",
]

CHARACTERS = [
    "a curious cat", "a retired astronaut", "a young inventor", "a lonely robot",
    "a shy dragon", "a detective who hates rain", "a grandmother who loves skateboarding",
    "a talking tree", "two rival bakers", "a lost penguin", "a time traveler",
    "a girl who can hear colors", "an old lighthouse keeper", "a nervous superhero",
]
EVENTS = [
    "finds a mysterious map", "loses their voice before a big concert",
    "wakes up in a different century", "has to save their village from a flood",
    "discovers a secret door", "wins a contest by accident", "makes an unexpected friend",
    "gets stuck in an elevator", "learns to fly", "receives a letter from the future",
]
PLACES = [
    "a busy market in Marrakech", "a quiet mountain village", "a rainy afternoon in London",
    "a beach at sunrise", "a night train across Europe", "a small bookshop",
    "a city park in autumn", "a crowded subway station", "a forest after snowfall",
]
PRODUCTS = [
    "a reusable water bottle", "noise-cancelling headphones", "a smart thermostat",
    "an ergonomic office chair", "a solar phone charger", "a cookbook for students",
    "a language learning app", "a folding electric bike", "handmade soap",
]
BUSINESSES = [
    "a bakery", "a bike repair shop", "a dog-walking service", "a vegan restaurant",
    "a coworking space", "a used bookstore", "a yoga studio", "a tutoring company",
]

RECIPIENTS = ["my manager", "a professor", "my landlord", "a customer", "my team",
              "a job recruiter", "a neighbor", "a colleague", "the school principal"]
PURPOSES = [
    "asking for a day off", "requesting an extension on a deadline", "about a broken heater",
    "apologizing for a late reply", "announcing a new project", "thanking them for their help",
    "asking for feedback on a report", "scheduling a meeting next week",
    "declining an invitation politely", "following up after an interview",
]

EMOTIONS = ["nervous", "stressed", "bored", "sad", "overwhelmed", "excited", "anxious", "stuck"]
SITUATIONS = [
    "starting a new job", "an exam next week", "moving abroad", "my final project",
    "a difficult conversation with a friend", "learning to drive", "my first marathon",
    "a presentation at work", "choosing a university",
]
RECOMMENDATIONS = [
    "a good science fiction book", "a board game for four people", "a healthy snack",
    "a beginner programming project", "a hobby that is cheap", "a podcast about history",
    "a weekend trip idea", "a gift for a friend who loves cooking", "a movie for a rainy day",
]
PROBLEMS = [
    "my laptop is very slow", "I keep forgetting things", "my plants keep dying",
    "I can't fall asleep", "my code throws an error I don't understand",
    "my roommate is too loud", "I spend too much money", "my bread doesn't rise",
    "my phone battery drains fast",
]
CHAT = [
    "Hello! Who are you?", "Tell me a joke.", "What can you help me with?",
    "Tell me a fun fact.", "Good morning! How are you today?", "Can you tell me a riddle?",
    "What's your favorite book and why?", "Say something nice to cheer me up.",
    "Tell me something interesting about space.", "What should I cook for dinner tonight?",
]

PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "storage"),
    ("Python lists", "tuples"), ("a crocodile", "an alligator"), ("speed", "velocity"),
    ("a simile", "a metaphor"), ("stocks", "bonds"), ("HTTP", "HTTPS"),
    ("a democracy", "a monarchy"), ("mitosis", "meiosis"), ("baking soda", "baking powder"),
    ("a comet", "an asteroid"), ("a lake", "a pond"), ("affect", "effect"),
    ("machine learning", "traditional programming"), ("tea", "coffee"),
    ("renting", "buying a home"), ("a laptop", "a tablet"), ("AC", "DC electricity"),
    ("weight", "mass"), ("a frog", "a toad"), ("SQL", "NoSQL databases"),
    ("a hurricane", "a tornado"), ("empathy", "sympathy"),
]

STYLES = [
    "", "", "", "", "", " Keep it short.", " Use bullet points.", " Explain it like I'm five.",
    " Answer in one paragraph.", " Be concise.", " Give an example.", " Use simple language.",
    " Answer in three sentences.", " Please be detailed.", " Use a numbered list.",
    " Write for a high school student.",
]

TRAIN_TEMPLATES: dict[str, list[str]] = {
    "explain": [
        "Explain {topic} in simple terms.", "How does {topic} work?",
        "What is {topic} and why does it matter?", "Give me a short overview of {topic}.",
        "Describe the history of {topic}.", "What are the main benefits and drawbacks of {topic}?",
        "Why do people care about {topic}?", "Teach me the basics of {topic}.",
        "What are common misconceptions about {topic}?", "Can you explain {topic} to a beginner?",
        "What should everyone know about {topic}?", "Write a short paragraph about {topic}.",
    ],
    "list": [
        "List {n} interesting facts about {topic}.", "Give me {n} tips for {activity}.",
        "What are {n} ways to {goal}?", "Name {n} {things}.", "List some {things}.",
        "What are the best tips for {activity}?", "Give me a checklist for {activity}.",
        "What are the steps for {activity}?",
    ],
    "code": [
        "Write a {lang} function that {code_task}.", "How do I write a {lang} program that {code_task}?",
        "Show me {lang} code that {code_task}, with comments.",
        "Write a function that {code_task} and explain how it works.",
        "Explain what this code does:\n```\n{snippet}\n```",
        "Is there a bug in this code? If so, fix it.\n```\n{snippet}\n```",
        "How can I make this code more readable?\n```\n{snippet}\n```",
        "What is {code_concept} in programming?", "Explain {code_concept} with an example.",
        "When should I use {code_concept}?",
    ],
    "math": [
        "What is {a} + {b}?", "Calculate {a} times {b}.", "What is {big} divided by {small}?",
        "What is {pct}% of {big}?", "Solve for x: {small}x + {a} = {c}.",
        "{name} has {a} {item}s and buys {b} more. How many {item}s does {name} have now?",
        "{name} had {c} {item}s and gave away {a}. How many are left?",
        "A train travels at {speed} km/h for {small} hours. How far does it go?",
        "A jacket costs ${big} and is on sale for {pct}% off. What is the sale price?",
        "What is the area of a rectangle with sides {a} and {b}?",
        "What is the area of a circle with radius {small}?", "Convert {big} kilometers to miles.",
        "Is {a} a prime number?", "What is the square root of {square}?",
        "Find the average of {a}, {b} and {c}.", "Explain {math_concept}.",
        "Can you give me an example of {math_concept}?",
        "If I save ${a} every week, how much will I have after {small} weeks?",
    ],
    "summarize": [
        "Summarize the following text in one sentence:\n\n{paragraph}",
        "Give me the key points of this passage:\n\n{paragraph}",
        "Summarize this for a busy reader:\n{paragraph}",
        "What is the main idea of this paragraph?\n\n{paragraph}",
        "Write a headline for this text:\n\n{paragraph}",
        "Rewrite this paragraph for a ten-year-old:\n\n{paragraph}",
        "List three questions a reader might ask after reading this:\n\n{paragraph}",
    ],
    "rewrite": [
        "Rewrite this sentence to sound more formal: {sentence}", "Make this sentence simpler: {sentence}",
        "Fix any grammar mistakes: {sentence}", "Paraphrase this sentence: {sentence}",
        "Rewrite this in a friendly tone: {sentence}", "Turn this into a question: {sentence}",
        "Translate into French: {sentence}", "Translate into Spanish: {sentence}",
        "Make this sentence more exciting: {sentence}", "Correct the spelling and punctuation: {sentence}",
    ],
    "creative": [
        "Write a short poem about {topic}.", "Write a haiku about {topic}.",
        "Write a short story about {character} who {event}.",
        "Describe {place} as if you were a travel writer.",
        "Write a product description for {product}.", "Come up with a slogan for {business}.",
        "Write the opening paragraph of a mystery novel set in {place}.",
        "Give me five name ideas for {business}.", "Write a funny dialogue between {character} and a waiter.",
    ],
    "email": [
        "Write an email to {recipient} {purpose}.", "Draft a short message to {recipient} {purpose}.",
        "Help me write a polite note to {recipient} {purpose}.",
    ],
    "advice": [
        "I'm feeling {emotion} about {situation}. Any advice?", "Can you recommend {recommendation}?",
        "What should I do if {problem}?", "Help me plan a week of {activity}.",
        "What's a good way to {goal}?", "{chat}", "How can I get better at {activity}?",
        "I want to {goal}. Where do I start?",
    ],
    "compare": [
        "What is the difference between {x} and {y}?", "Compare {x} and {y}.",
        "Which is better for a beginner: {x} or {y}?", "What do {x} and {y} have in common?",
    ],
}
CATEGORY_WEIGHTS = {
    "explain": 18, "list": 12, "code": 16, "math": 12, "summarize": 8, "rewrite": 8,
    "creative": 10, "email": 5, "advice": 7, "compare": 6,
}

# ---- held-out vocabulary (disjoint from the above) ----------------------------------------------
HELDOUT_TOPICS = [
    "tsunamis", "the Silk Road", "quantum computing", "penguins", "the Eiffel Tower",
    "origami", "jellyfish", "hot air balloons", "the Byzantine Empire", "wildfires",
    "submarines", "sourdough starters", "northern lights", "the Great Barrier Reef",
    "microplastics", "sign language", "beekeeping", "vinyl records", "lighthouses", "sushi",
]
HELDOUT_TEMPLATES: dict[str, list[str]] = {
    "explain": [
        "I've always wondered about {topic}. Can you shed some light on it?",
        "Write a brief encyclopedia entry on {topic}.",
        "What would a scientist say are the three most important things about {topic}?",
    ],
    "list": [
        "Make a packing list for {trip}.", "Suggest {n} questions to ask about {topic} on a quiz.",
    ],
    "code": [
        "Using {lang}, implement a routine that {code_task}.",
        "Describe an algorithm that {code_task}, then give {lang} code for it.",
    ],
    "math": [
        "A recipe needs {a} grams of flour for {small} pancakes. How much flour for {b} pancakes?",
        "A rectangle has a perimeter of {c} cm and one side of {small} cm. What is the other side?",
        "How many minutes are there in {a} hours and {b} minutes?",
    ],
    "creative": [
        "Write a limerick about {topic}.", "Compose a diary entry from the point of view of {who}.",
    ],
    "rewrite": ["Rephrase this for a job application: {sentence}"],
    "advice": ["My friend says {claim}. Is that true?"],
}
HELDOUT_SLOTS = {
    "trip": ["a week of skiing", "a beach holiday", "a business trip to Tokyo", "a camping weekend"],
    "lang": ["Python", "JavaScript", "Kotlin", "Ruby"],
    "code_task": [
        "computes the median of a list", "checks that an email address looks valid",
        "converts Roman numerals to integers", "finds the most common letter in a string",
        "merges overlapping intervals", "returns the n-th prime number",
    ],
    "who": ["a house cat", "a medieval knight", "a Mars rover", "a bakery owner"],
    "sentence": [
        "I am good at working with people and computers.", "I want this job because I like it.",
        "I fixed many problems at my last job.",
    ],
    "claim": [
        "we only use ten percent of our brains", "goldfish have a three-second memory",
        "lightning never strikes the same place twice", "cracking your knuckles causes arthritis",
    ],
}

# fmt: on
